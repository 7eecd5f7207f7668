"""Trainer: output layout, exact resume (stopped and killed), fine-tuning, config files, bad input."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
import torch
from killing import kill_training_after
from safetensors.torch import load_file
from tiny import make_tiny, save_tiny, tiny_tokenizer

from outrider.cli import main as cli_main
from outrider.config import PRESETS, TrainConfig
from outrider.errors import UserError
from outrider.interop.checkpoint import load_head
from outrider.train.data.datasets import load_dataset
from outrider.train.data.prepare import build_dataset
from outrider.train.data.vocab import DraftVocab, build_draft_vocab
from outrider.train.loop.metrics import tau_at
from outrider.train.loop.trainer import lr_factor, train
from outrider.train.options import TrainOptions

CFG = TrainConfig(steps=12, batch_size=2, grad_accum=2, max_length=48, lr=3e-3, warmup_steps=2, ttt_steps=3,
                  draft_vocab_size=40, eval_every=4, save_every=3, eval_examples=6, log_every=1,
                  aux_layer_ids=(1, 2, 3))


def _conversations(path: Path, n: int, seed: int, lo: int, hi: int) -> Path:
    """ShareGPT records over the tiny vocabulary; replies are arithmetic runs of word ids in [lo, hi)."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        turns = []
        for _ in range(2):
            words = " ".join(f"w{rng.randrange(5, 90)}" for _ in range(rng.randrange(3, 8)))
            turns.append({"from": "human", "value": words})
            start, step = rng.randrange(hi - lo), rng.choice([1, 2, 3])
            turns.append({"from": "gpt", "value": " ".join(f"w{lo + (start + step * k) % (hi - lo)}"
                                                          for k in range(rng.randrange(6, 16)))})
        records.append({"id": f"c{i}", "conversations": turns})
    path.write_text(json.dumps(records))
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    target = save_tiny("llama", root / "tiny")
    data = root / "data"
    build_dataset(str(target), str(_conversations(root / "a.json", 36, 0, 5, 60)), str(data), eval_fraction=0.2,
                  progress=False)
    other = root / "other"  # another token distribution: another draft vocabulary
    build_dataset(str(target), str(_conversations(root / "b.json", 36, 1, 50, 93)), str(other), eval_fraction=0.2,
                  progress=False)
    return {"root": root, "target": str(target), "data": str(data), "other": str(other)}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def _digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _train_records(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


@pytest.fixture(scope="module")
def straight(env):
    """One uninterrupted run of CFG, the reference for the resume tests."""
    out = env["root"] / "straight"
    report = train(TrainOptions(env["target"], env["data"], str(out), config=CFG, progress=False))
    return out, report


# ---------------------------------------------------------------------------------------------
# Config


def test_config_round_trip_presets_and_errors(tmp_path):
    for name, preset in PRESETS.items():
        assert TrainConfig.preset(name) == preset
        assert TrainConfig.from_dict(json.loads(preset.to_json())) == preset
    path = CFG.save(tmp_path / "c.json")
    assert TrainConfig.load(path) == CFG
    assert CFG.to_dict()["aux_layer_ids"] == [1, 2, 3]
    with pytest.raises(UserError, match="unknown training setting.*learning_rate"):
        TrainConfig.from_dict({"learning_rate": 1e-3})
    with pytest.raises(UserError, match="warmup_steps"):
        CFG.replace(warmup_steps=CFG.steps + 1)
    with pytest.raises(UserError, match="unknown training preset"):
        TrainConfig.preset("medium")
    with pytest.raises(UserError, match="loss_kernel"):
        CFG.replace(loss_kernel="cuda")
    with pytest.raises(UserError, match="ttt_attention"):
        CFG.replace(ttt_attention="sparse")
    with pytest.raises(UserError, match="min_batch_tokens"):
        CFG.replace(min_batch_tokens=-1)
    # a token floor applies to batches by count drawn by length only; elsewhere it bounds nothing
    assert CFG.replace(min_batch_tokens=200).max_batch_tokens == 400
    assert CFG.replace(min_batch_tokens=200, batch_tokens=120).max_batch_tokens == max(120, 2 * 48)
    assert CFG.replace(min_batch_tokens=200, group_by_length=0).max_batch_tokens == 2 * 48
    assert not PRESETS["full"].replace(batch_tokens=49152).joins_batches
    # warmup then cosine down to min_lr_ratio
    c = TrainConfig(steps=10, warmup_steps=2, min_lr_ratio=0.1)
    assert [round(lr_factor(s, c), 4) for s in (0, 1, 2, 10)] == [0.5, 1.0, 1.0, 0.1]
    # a time budget half spent puts the cosine half way, however few steps were done; warm-up stays by steps
    assert lr_factor(3, c, budget_used=0.5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(3, c, budget_used=0.0) == lr_factor(3, c) > lr_factor(3, c, budget_used=0.5)
    assert lr_factor(0, c, budget_used=0.9) == 0.5 and lr_factor(3, c, budget_used=2.0) == pytest.approx(0.1)
    assert tau_at([0.5, 0.5, 0.5], 2) == 1.75


# ---------------------------------------------------------------------------------------------
# A run and what it writes


def test_run_writes_servable_head_state_and_metrics(env, straight):
    out, report = straight
    assert report.steps == 12 and report.global_batch == 4 and report.world_size == 1
    assert sorted(p.name for p in out.iterdir()) == ["head", "last", "metrics.jsonl", "train_config.json"]
    # the draft vocabulary is the top-40 of the training split's loss-masked tokens
    ds = load_dataset(env["data"])
    pairs = ((ids.astype("int64"), mask.astype("int64")) for ids, mask in zip(ds.input_ids, ds.loss_mask))
    want = build_draft_vocab(pairs, 96, 40)
    assert DraftVocab.load(out / "last").fingerprint() == want.fingerprint()
    for folder in (out / "head", out / "last" / "head"):
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 40
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang's Llama adds 1
        assert cfg["outrider"]["draft_vocab"]["fingerprint"] == want.fingerprint()
        head, _ = load_head(folder)
        assert torch.equal(head.map_to_target(torch.arange(40)), want.draft_ids)
        assert set(_tensors(folder)) == set(head.state_dict())
    # the best head is the eval's best by simulated tau, saved at that step
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8, 12]
    # evaluations on the eval split also walk it round by round: an acceptance length in [1, 1 + tau_k]
    assert all(1.0 <= r["walk_tau_k"] <= 1.0 + 5 for r in evals if r["source"] == "eval")
    assert any(r["source"] == "eval" for r in evals)
    best = max(evals, key=lambda r: r["sim_tau_k"])
    assert report.best_step == best["step"] and report.best_sim_tau == pytest.approx(best["sim_tau_k"])
    assert json.loads((out / "head" / "config.json").read_text())["outrider"]["training"]["step"] == best["step"]
    train_recs = _train_records(out)
    assert [r["step"] for r in train_recs] == list(range(1, 13))
    assert all(len(r["per_step_acc"]) == 3 and r["tokens_per_s"] > 0 for r in train_recs)
    # learning happens: the mean loss of the last 4 steps is below that of the first 4
    assert sum(r["loss"] for r in train_recs[-4:]) < sum(r["loss"] for r in train_recs[:4])
    state = json.loads((out / "last" / "trainer_state.json").read_text())
    assert state["step"] == 12 and state["position"]["seed"] == CFG.seed
    assert json.loads((out / "train_config.json").read_text())["config"] == CFG.to_dict()


# ---------------------------------------------------------------------------------------------
# Exact resume


def test_stop_then_resume_is_bit_identical(env, straight):
    ref, _ = straight
    out = env["root"] / "stopped"
    first = train(TrainOptions(env["target"], env["data"], str(out), config=CFG, max_steps=5, progress=False))
    assert first.steps == 5 and json.loads((out / "last" / "trainer_state.json").read_text())["step"] == 5
    second = train(TrainOptions(env["target"], env["data"], str(out), resume=True, progress=False))
    assert second.resumed_from == 5 and second.steps == 12
    a, b = _tensors(ref / "last" / "head"), _tensors(out / "last" / "head")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in _train_records(ref)] == [r["loss"] for r in _train_records(out)]
    sa = torch.load(ref / "last" / "trainer_state.pt", weights_only=False)
    sb = torch.load(out / "last" / "trainer_state.pt", weights_only=False)
    for k, st in sa["optimizer"]["state"].items():
        assert torch.equal(st["exp_avg_sq"], sb["optimizer"]["state"][k]["exp_avg_sq"])
    assert sa["position"] == sb["position"] and sa["scheduler"] == sb["scheduler"]


def test_steps_queued_ahead_train_exactly_as_steps_read_one_by_one(env, straight, tmp_path):
    """The next step is queued before this one's metrics are read, except after the first step and
    the steps that evaluate or checkpoint; the run is bit-identical to one that waits for each step."""
    ref, _ = straight
    assert CFG.run_ahead
    out = tmp_path / "sync"
    train(TrainOptions(env["target"], env["data"], str(out), config=CFG.replace(run_ahead=False), progress=False))
    ahead, sync = _train_records(ref), _train_records(out)
    assert [r["step"] for r in ahead if r["ahead"]] == [3, 6, 8, 11, 12]  # eval every 4, save every 3, 12 steps
    assert not any(r["ahead"] for r in sync)
    for key in ("loss", "per_step_acc", "grad_norm", "lr", "epoch", "tokens"):
        assert [r[key] for r in ahead] == [r[key] for r in sync], key
    evals = [[(r["step"], r["loss"], r["walk_tau_k"]) for r in map(json.loads, (d / "metrics.jsonl").read_text()
              .splitlines()) if r["type"] == "eval"] for d in (ref, out)]
    assert evals[0] == evals[1] and len(evals[0]) == 3  # evaluations see the same weights
    a, b = _tensors(ref / "last" / "head"), _tensors(out / "last" / "head")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(UserError, match="run_ahead"):
        CFG.replace(run_ahead="yes")


def test_epoch_labels_name_the_epoch_each_step_read(env, straight):
    from outrider.train.data.datasets import BatchCursor
    from outrider.train.loop import dist

    cursor = BatchCursor(load_dataset(env["data"]), CFG, dist.init_from_env("cpu"), CFG.seed)
    want = []
    for _ in range(CFG.steps):
        for _ in range(CFG.grad_accum):
            cursor.next()
        want.append(cursor.epoch)
    assert 1 in want and [r["epoch"] for r in _train_records(straight[0])] == want


def test_a_step_queued_when_the_budget_runs_out_is_finished_and_counted(env, tmp_path, monkeypatch):
    from outrider.train.loop.trainer import _Trainer

    monkeypatch.setattr(_Trainer, "_over_budget", lambda self, train_s: self.step >= 5)  # step 6 is queued then
    out = tmp_path / "budget-queued"
    report = train(TrainOptions(env["target"], env["data"], str(out), config=CFG.replace(time_budget_s=1e9),
                                progress=False))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [r["ahead"] for r in records if r["type"] == "train"][-1] is True
    assert [r["step"] for r in records if r["type"] == "eval"] == [4, 6]
    assert report.steps == 6 and any("at step 6 of 12" in n for n in report.notes)
    assert json.loads((out / "last" / "trainer_state.json").read_text())["step"] == 6


def test_a_non_finite_step_read_with_the_next_queued_keeps_the_last_checkpoint(env, tmp_path, monkeypatch):
    from outrider.train.loop.trainer import _Trainer

    launch = _Trainer._launch_step

    def nan_grad_norm_at_step_5(self, objective):
        launched = launch(self, objective)
        if self.step == 4 and not getattr(self, "_spoiled", False):  # the launch of step 5
            self._spoiled = True
            launched.sums.stage(torch.tensor([float("nan")]))
        return launched

    monkeypatch.setattr(_Trainer, "_launch_step", nan_grad_norm_at_step_5)
    out = tmp_path / "nan-queued"
    with pytest.raises(UserError, match="non-finite gradient norm at step 5.*intact"):
        train(TrainOptions(env["target"], env["data"], str(out), config=CFG, progress=False))
    assert json.loads((out / "last" / "trainer_state.json").read_text())["step"] == 3  # save_every 3
    assert [r["step"] for r in _train_records(out)] == [1, 2, 3, 4]


def test_token_budget_batches_train_and_resume_bit_identical(env, tmp_path):
    cfg = CFG.replace(batch_tokens=120, steps=10, eval_every=5, save_every=5)  # ~3 sequences of <= 48 tokens
    ref = train(TrainOptions(env["target"], env["data"], str(tmp_path / "a"), config=cfg, progress=False))
    assert ref.steps == 10 and ref.global_batch == 0 and ref.global_batch_tokens == 240
    assert "240 padded tokens" in ref.summary()
    first = train(TrainOptions(env["target"], env["data"], str(tmp_path / "b"), config=cfg, max_steps=4,
                               progress=False))
    second = train(TrainOptions(env["target"], env["data"], str(tmp_path / "b"), resume=True, progress=False))
    assert first.steps == 4 and second.steps == 10
    records = [_train_records(tmp_path / d) for d in ("a", "b")]
    assert [r["loss"] for r in records[0]] == [r["loss"] for r in records[1]]
    assert max(r["epoch"] for r in records[0]) >= 1  # crossed an epoch: its length is recomputed
    a, b = _tensors(tmp_path / "a" / "last" / "head"), _tensors(tmp_path / "b" / "last" / "head")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_token_floor_joins_short_batches_in_training(env, tmp_path):
    plain_cfg = CFG.replace(group_by_length=4, steps=6, eval_every=6, save_every=6)
    cfg = plain_cfg.replace(min_batch_tokens=200)
    assert cfg.max_batch_tokens == 400
    train(TrainOptions(env["target"], env["data"], str(tmp_path / "a"), config=plain_cfg, progress=False))
    rep = train(TrainOptions(env["target"], env["data"], str(tmp_path / "b"), config=cfg, progress=False))
    plain, joined = _train_records(tmp_path / "a"), _train_records(tmp_path / "b")
    assert rep.steps == 6 and len(joined) == 6
    most = CFG.grad_accum * CFG.batch_size * CFG.max_length  # real tokens a step of two-sequence batches can hold
    assert max(r["tokens"] for r in plain) <= most < min(r["tokens"] for r in joined)
    assert max(r["tokens"] for r in joined) <= CFG.grad_accum * cfg.max_batch_tokens


def test_killed_run_resumes_bit_identical(env, straight, tmp_path):
    ref, _ = straight
    out = tmp_path / "killed"
    cfg_path = CFG.replace(save_every=1).save(tmp_path / "cfg.json")
    code = ("import sys; from outrider.train.loop.trainer import train; "
            "from outrider.train.options import TrainOptions; "
            "train(TrainOptions(sys.argv[1], sys.argv[2], sys.argv[3], config=sys.argv[4], progress=False))")
    killed_at = kill_training_after(code, [env["target"], env["data"], str(out), str(cfg_path)], out)
    assert 2 <= killed_at < 12
    report = train(TrainOptions(env["target"], env["data"], str(out), resume=True, progress=False))
    assert report.resumed_from == killed_at and report.steps == 12
    a, b = _tensors(ref / "last" / "head"), _tensors(out / "last" / "head")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in _train_records(out)] == list(range(1, 13))  # lines past the checkpoint were cut


# ---------------------------------------------------------------------------------------------
# Fine-tuning and bad input: one line, nothing already written is lost


def test_a_split_drawn_one_by_one_is_noted(env, tmp_path):
    """Data built before the split kept openings together: its eval scores may read high, and the
    run's summary says so."""
    import shutil

    old = tmp_path / "old-data"
    shutil.copytree(env["data"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest.pop("split_by")
    (old / "manifest.json").write_text(json.dumps(manifest))
    report = train(TrainOptions(env["target"], str(old), str(tmp_path / "run"),
                                config=CFG.replace(steps=2, eval_every=2, save_every=2), progress=False))
    assert any("split_by" in n and "split_check" in n for n in report.notes), report.notes


def test_init_fine_tunes_and_keeps_the_heads_vocabulary_on_other_data(env, straight, tmp_path):
    ref, _ = straight
    report = train(TrainOptions(env["target"], env["data"], str(tmp_path / "ft"), init=str(ref / "head"),
                                config=CFG.replace(steps=2, eval_every=2, save_every=2), progress=False))
    assert report.steps == 2 and not any("draft vocabulary" in n for n in report.notes)
    assert not any("split_by" in n for n in report.notes)  # the split keeps openings together
    first = _train_records(tmp_path / "ft")[0]
    assert first["loss"] < _train_records(ref)[0]["loss"]  # it started from the trained head
    other = train(TrainOptions(env["target"], env["other"], str(tmp_path / "ft2"), init=str(ref / "head"),
                               config=CFG.replace(steps=2, eval_every=2, save_every=2), progress=False))
    note = next(n for n in other.notes if "kept the --init head's draft vocabulary" in n)
    mine = DraftVocab.load(ref / "last")
    theirs = DraftVocab.load(tmp_path / "ft2" / "last")
    assert torch.equal(theirs.draft_ids, mine.draft_ids) and theirs.coverage() < 1.0  # other data, same rows
    assert f"{100 * theirs.coverage():.2f} %" in note and other.vocab_coverage == pytest.approx(theirs.coverage())
    head = load_head(tmp_path / "ft2" / "head")[0]
    assert torch.equal(head.d2t.cpu(), mine.d2t)
    cfg = CFG.replace(steps=4, eval_every=4, save_every=2)  # a fine-tune that keeps its vocabulary resumes
    train(TrainOptions(env["target"], env["other"], str(tmp_path / "ft3"), init=str(ref / "head"), config=cfg,
                       max_steps=2, progress=False))
    resumed = train(TrainOptions(env["target"], env["other"], str(tmp_path / "ft3"), resume=True, progress=False))
    assert resumed.resumed_from == 2 and resumed.steps == 4
    assert torch.equal(DraftVocab.load(tmp_path / "ft3" / "last").draft_ids, mine.draft_ids)
    with pytest.raises(UserError, match="training data.s content changed"):
        train(TrainOptions(env["target"], env["data"], str(tmp_path / "ft3"), resume=True, progress=False))


def test_resume_refusals_keep_the_checkpoint(env, straight, tmp_path):
    ref, _ = straight
    before = {d: _digest(ref / d) for d in ("head", "last")}
    with pytest.raises(UserError, match="training data.s content changed"):
        train(TrainOptions(env["target"], env["other"], str(ref), resume=True, progress=False))
    with pytest.raises(UserError, match="already holds a training run"):
        train(TrainOptions(env["target"], env["data"], str(ref), config=CFG, progress=False))
    with pytest.raises(UserError, match="nothing to resume"):
        train(TrainOptions(env["target"], env["data"], str(tmp_path / "empty"), resume=True, progress=False))
    assert {d: _digest(ref / d) for d in ("head", "last")} == before


def test_nan_loss_stops_and_keeps_last_good_checkpoint(env, tmp_path):
    out = tmp_path / "nan"
    train(TrainOptions(env["target"], env["data"], str(out), config=CFG, max_steps=3, progress=False))
    before = {d: _digest(out / d) for d in ("head", "last")}
    broken = make_tiny("llama")
    with torch.no_grad():
        broken.lm_head.weight[5] = float("nan")  # a corrupted target: its teacher turns NaN
    with pytest.raises(UserError, match="non-finite loss at step 4.*intact"):
        train(TrainOptions(env["target"], env["data"], str(out), resume=True, progress=False),
              loaded_target=(broken, tiny_tokenizer()))
    assert {d: _digest(out / d) for d in ("head", "last")} == before


def test_empty_and_too_small_datasets_are_one_line_errors(env, tmp_path, capsys):
    empty = tmp_path / "empty_data"
    empty.mkdir()
    manifest = json.loads((Path(env["data"]) / "manifest.json").read_text())
    manifest["splits"] = {s: {"examples": 0, "tokens": 0, "loss_tokens": 0, "shards": []} for s in ("train", "eval")}
    (empty / "manifest.json").write_text(json.dumps(manifest))
    cfg = CFG.save(tmp_path / "cfg.json")
    rc = cli_main(["train", env["target"], "--data", str(empty), "--out", str(tmp_path / "o"), "--config", str(cfg),
                   "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "no train examples" in err
    with pytest.raises(UserError, match="fewer than one batch"):
        train(TrainOptions(env["target"], env["data"], str(tmp_path / "o2"), config=CFG.replace(batch_size=64),
                           progress=False))
    with pytest.raises(UserError, match="not an outrider token dataset"):
        train(TrainOptions(env["target"], str(tmp_path), str(tmp_path / "o3"), config=CFG, progress=False))
    assert not (tmp_path / "o").exists() and not (tmp_path / "o2").exists()


def test_time_budget_ends_the_run_with_a_head(env, tmp_path):
    """A run over its training-time budget stops after the step that crossed it: final eval,
    checkpoint and head written, the early stop named in the report."""
    out = tmp_path / "budget"
    report = train(TrainOptions(env["target"], env["data"], str(out), config=CFG.replace(time_budget_s=1e-9),
                                progress=False))
    assert report.steps == 1 and report.schedule_steps == CFG.steps
    assert any("time budget" in n for n in report.notes)
    assert (out / "head" / "model.safetensors").is_file() and (out / "last").is_dir()
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["type"] == "eval"] == [1]


def test_init_layer_from_target_starts_as_the_targets_last_layer(env, tmp_path):
    """``init_layer_from_target``: before any update the head's step on (embedding e, aux states)
    equals the target's last decoder layer applied to the last aux state (the embedding half of
    the projections is zero, fc passes the last aux state through)."""
    from outrider.train.loop import dist
    from outrider.train.loop.trainer import _Trainer

    cfg = CFG.replace(init_layer_from_target=True)
    options = TrainOptions(env["target"], env["data"], str(tmp_path / "run"), config=cfg, progress=False)
    tr = _Trainer(dist.init_from_env("cpu"), options)
    model, head = tr.target.model, tr.head
    ids = torch.tensor([[5, 17, 23, 42, 8, 61]])
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[j] for j in head.config.aux_layer_ids], dim=-1)  # [1, 6, 3H]
        h = head.fuse(aux)
        assert torch.equal(h, states[head.config.aux_layer_ids[-1]])
        positions = torch.arange(ids.shape[1])[None]
        ours = head.forward_hidden(head.embed(ids) if head._embedding else model.get_input_embeddings()(ids), h,
                                   positions)
        rotary = model.model.rotary_emb(h, positions)
        theirs = model.model.layers[-1](h, attention_mask=None, position_ids=positions,
                                        position_embeddings=rotary)
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_an_mla_head_with_3_1_norms_trains_fine_tunes_and_benches(env, tmp_path):
    """head_attention "mla" (and the EAGLE 3.1 norms) through the whole path: a run writes an MLA head in the
    engines' layout, --init fine-tunes it as an MLA head, and bench --draft drafts losslessly with it."""
    from outrider.bench.local import bench

    cfg = CFG.replace(steps=3, eval_every=3, save_every=3, head_attention="mla", head_fc_norm=True,
                      head_norm_output=True)
    train(TrainOptions(env["target"], env["data"], str(tmp_path / "mla"), config=cfg, progress=False))
    written = json.loads((tmp_path / "mla/head/config.json").read_text())
    assert written["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and written["fc_norm"] is True
    head, hcfg = load_head(tmp_path / "mla/head")
    assert hcfg.attention == "mla" and hcfg.norm_output and head.fc_norm is not None
    # a fine-tune keeps the --init head's attention whatever the config asks
    report = train(TrainOptions(env["target"], env["data"], str(tmp_path / "ft"), init=str(tmp_path / "mla/head"),
                                config=CFG.replace(steps=2, eval_every=2, save_every=2), progress=False))
    assert report.steps == 2 and load_head(tmp_path / "ft/head")[1].attention == "mla"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7 w5 w6 w7\nw9 w10 w11 w12 w9 w10\n")
    record = bench(env["target"], "eagle3", draft=str(tmp_path / "ft/head"), k=3, num_prompts=2, max_new_tokens=12,
                   prompts=str(prompts), device="cpu")
    assert record["lossless"] is True and record["new_tokens"] > 0


def test_the_three_target_sides_have_the_protocols_methods():
    """``TargetSide`` (``outrider.train.states.side``): online, cached and streamed sides implement it."""
    from outrider.train.states.features import CachedTarget, OnlineTarget
    from outrider.train.states.side import TargetSide
    from outrider.train.states.stream_train import StreamedOnline

    methods = [n for n, v in vars(TargetSide).items() if callable(v) and not n.startswith("_")]
    assert "feature_source" in methods and "follow" in methods
    for side in (OnlineTarget, CachedTarget, StreamedOnline):
        assert all(callable(getattr(side, n, None)) for n in methods), side
