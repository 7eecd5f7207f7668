"""Hidden-state cache: capture (layout, resume after SIGKILL, bad input), training from it (equal to
online training in float32, exact resume, no target built), compact fp8 storage."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from killing import kill_training_after
from safetensors.torch import load_file
from test_trainer import _conversations
from tiny import save_tiny

from outrider.cli import main as cli_main
from outrider.config import TrainConfig
from outrider.errors import UserError
from outrider.train.data.prepare import build_dataset
from outrider.train.loop.trainer import train
from outrider.train.options import TrainOptions
from outrider.train.states import cache as cache_mod
from outrider.train.states.cache import OutriderCache, dequantize, quantize, teacher_rows
from outrider.train.states.cache_capture import capture_cache

CFG = TrainConfig(steps=4, batch_size=2, grad_accum=2, max_length=48, lr=3e-3, warmup_steps=1, ttt_steps=3,
                  draft_vocab_size=40, eval_every=4, save_every=2, eval_examples=6, log_every=1)
AUX = (1, 2, 3)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    out = {"root": root}
    for kind in ("llama", "deepseek_v3"):
        target = save_tiny(kind, root / kind)
        data = root / f"data-{kind}"
        build_dataset(str(target), str(_conversations(root / "a.json", 30, 0, 5, 60)), str(data), eval_fraction=0.2,
                      progress=False)
        out[kind] = (str(target), str(data))
    return out


def _capture(env, kind: str, dtype: str, name: str | None = None, **kw) -> str:
    target, data = env[kind]
    out = env["root"] / (name or f"c-{kind}-{dtype}")
    if not (out / "manifest.json").exists():
        capture_cache(target, data, str(out), dtype=dtype, aux_layer_ids=AUX, max_tokens_per_shard=300,
                      progress=False, **kw)
    return str(out)


def _losses(out: Path, kind: str = "train") -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("shard-*"))}


# ---------------------------------------------------------------------------------------------
# Layout and values


def test_layout_header_manifest_and_what_is_stored(env):
    path = Path(_capture(env, "llama", "float32"))
    header = json.loads((path / "header.json").read_text())
    assert header["aux_layer_ids"] == list(AUX) and "entering decoder layer j" in header["aux_semantics"]
    assert header["target"]["hidden_size"] == 64 and len(header["target"]["weights_sha256"]) == 64
    assert header["dtype"] == "float32" and header["scaling"] is None
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) == header["shards"] > 2
    reader = OutriderCache(path)
    ids, masks, _ = reader.examples("train")
    assert len(ids) == header["data"]["splits"]["train"]["examples"]
    for entry in manifest["shards"]:
        blob = (path / entry["file"]).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == entry["sha256"]
        assert entry["tokens"] <= 300 or len(entry["examples"]["length"]) == 1
        cols = entry["examples"]
        for j in range(len(cols["index"])):
            mask = masks[cols["index"][j]] if cols["split"][j] == "train" else None
            if mask is None:
                continue
            # the byte offsets point at the example's first aux and final rows
            st = reader.read("train", cols["index"][j])
            assert blob[cols["aux_offset"][j]: cols["aux_offset"][j] + 4] == st.aux[0, 0, :1].numpy().tobytes()
            if st.rows.numel():
                assert blob[cols["final_offset"][j]: cols["final_offset"][j] + 4] == st.final[0, :1].numpy().tobytes()
            assert torch.equal(st.rows, torch.from_numpy(teacher_rows(mask)))  # final states at teacher rows only
            assert st.aux.shape == (len(mask), 3, 64)


def test_stored_states_are_the_targets_and_fp8_is_close(env):
    from outrider.models import load_model

    target, data = env["llama"]
    model, _ = load_model(target, device="cpu", dtype="float32", with_tokenizer=False)
    f32, fp8 = OutriderCache(_capture(env, "llama", "float32")), OutriderCache(_capture(env, "llama", "fp8"))
    ids, masks, _ = f32.examples("train")
    with torch.no_grad():
        out = model(torch.as_tensor(ids[0][None].astype(np.int64)), output_hidden_states=True)
    want_aux = torch.stack([out.hidden_states[j][0] for j in AUX], 1)  # [len, 3, H]
    st = f32.read("train", 0)
    assert torch.allclose(st.aux, want_aux, atol=1e-5)
    assert torch.allclose(st.final, out.hidden_states[-1][0][st.rows], atol=1e-5)  # after the final norm
    q = fp8.read("train", 0)
    assert q.aux.dtype == torch.float8_e4m3fn and q.aux_scale.shape == (len(ids[0]), 3, 1)
    err = (dequantize(q.aux, q.aux_scale, torch.float32) - st.aux).norm() / st.aux.norm()
    assert 0 < err < 0.05  # e4m3: 3 mantissa bits


def test_quantize_blocks_and_bytes_per_token(env):
    x = torch.randn(5, 3, 64) * torch.logspace(-2, 2, 64)
    for block in (64, 16):
        q, s = quantize(x, block)
        assert s.shape == (5, 3, 64 // block)
        assert ((dequantize(q, s, torch.float32) - x).abs() <= x.abs().amax() * 2 ** -3).all()
    # stored bytes: fp8 = 3H + 12 (scales) + f (H + 4) + 5 (ids, mask) per token, plus the files' headers
    for dtype, aux_b, final_b, scale_b in (("fp8", 1, 1, 4), ("bf16", 2, 2, 0), ("float32", 4, 4, 0)):
        path = Path(_capture(env, "llama", dtype))
        m = json.loads((path / "manifest.json").read_text())
        rows = sum(e["final_rows"] for e in m["shards"])
        expect = m["tokens"] * (3 * 64 * aux_b + 3 * scale_b + 5) + rows * (64 * final_b + scale_b)
        assert expect < m["bytes"] < expect + 2048 * len(m["shards"])


# ---------------------------------------------------------------------------------------------
# Training from a cache equals online training


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_cache_training_equals_online_training(env, kind, monkeypatch):
    target, data = env[kind]
    cache = _capture(env, kind, "float32")
    root = env["root"]
    online = train(TrainOptions(target, data, str(root / f"online-{kind}"), config=CFG.replace(aux_layer_ids=AUX),
                                progress=False))

    def refuse(*a, **k):
        raise AssertionError("training from a cache built the target")

    monkeypatch.setattr("outrider.models.load_model", refuse)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", refuse)
    cached = train(TrainOptions(target, None, str(root / f"cached-{kind}"), config=CFG, progress=False, cache=cache))
    a, b = _losses(root / f"online-{kind}"), _losses(root / f"cached-{kind}")
    assert len(a) == len(b) == CFG.steps
    assert np.allclose(a, b, rtol=1e-5, atol=0), (a, b)
    assert np.allclose(_losses(root / f"online-{kind}", "eval"), _losses(root / f"cached-{kind}", "eval"), rtol=1e-5)
    assert cached.final_eval["walk_tau_k"] == pytest.approx(online.final_eval["walk_tau_k"], rel=1e-6)
    head = json.loads((root / f"cached-{kind}" / "head" / "config.json").read_text())
    assert head["eagle_aux_hidden_state_layer_ids"] == list(AUX)  # the cache's ids


def test_topk_teacher_keeps_the_k_logits_and_spreads_the_rest_evenly():
    torch.manual_seed(0)
    V, M = 50, 6
    logits = torch.randn(M, V) * 3  # the target's, over its vocabulary
    draft_ids = torch.tensor(sorted(torch.randperm(V)[:20].tolist()))
    draft_index = torch.full((V,), -1, dtype=torch.long)
    draft_index[draft_ids] = torch.arange(20)
    exact = logits[:, draft_ids]  # the teacher a final state gives: the draft rows' logits
    lse = torch.logsumexp(logits, -1)
    values, ids = logits.topk(V, -1)
    whole = cache_mod.topk_teacher(ids, values, lse, draft_index, V, torch.float32)
    assert torch.equal(whole, exact)  # K = vocabulary: the same logits, nothing spread
    values, ids = logits.topk(8, -1)
    part = cache_mod.topk_teacher(ids, values, lse, draft_index, V, torch.float32)
    kept = draft_index[ids] >= 0
    rows = torch.nonzero(kept, as_tuple=True)[0]
    assert torch.equal(part[rows, draft_index[ids][kept]], values[kept])  # the k logits as they were
    p = torch.softmax(logits, -1)
    rest = 1 - p.gather(1, ids).sum(-1)  # the tail's mass, shared evenly by the other V - 8 tokens
    others = torch.ones(M, V, dtype=torch.bool).scatter_(1, ids, False)[:, draft_ids]  # [M, 20]
    spread = torch.exp(part - lse[:, None])[others]
    assert torch.allclose(spread, (rest[:, None] / (V - 8)).expand(M, 20)[others], rtol=1e-5)


def test_a_topk_cache_is_smaller_and_with_the_whole_vocabulary_trains_as_online(env, monkeypatch):
    target, data = env["llama"]
    root = env["root"]
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    whole = _capture(env, "llama", "float32", name="c-topk-all", teacher_topk=vocab)
    st = OutriderCache(whole).read("train", 0)
    assert st.final is None and st.teacher_ids.shape == (st.rows.numel(), vocab)
    assert json.loads((Path(whole) / "header.json").read_text())["teacher"]["kind"] == "topk"
    online = root / "online-llama"
    if not (online / "metrics.jsonl").exists():
        train(TrainOptions(target, data, str(online), config=CFG.replace(aux_layer_ids=AUX), progress=False))
    monkeypatch.setattr("outrider.models.load_model", lambda *a, **k: pytest.fail("built the target"))
    train(TrainOptions(target, None, str(root / "cached-topk-all"), config=CFG, progress=False, cache=whole))
    assert np.allclose(_losses(online), _losses(root / "cached-topk-all"), rtol=1e-5, atol=0)
    small = _capture(env, "llama", "fp8", name="c-topk-8", teacher_topk=8)
    full = _capture(env, "llama", "fp8")
    sizes = [json.loads((Path(c) / "manifest.json").read_text()) for c in (small, full)]
    rows = sum(e["final_rows"] for e in sizes[1]["shards"])
    # fp8 final states: H + 4 bytes a teacher row; top-8: 8 x (4 + 2) + 4 (the files' headers aside)
    saved = sizes[1]["bytes"] - sizes[0]["bytes"]
    assert abs(saved - rows * ((64 + 4) - (6 * 8 + 4))) < 1024 * len(sizes[0]["shards"])
    report = train(TrainOptions(target, None, str(root / "cached-topk-8"), config=CFG, progress=False, cache=small))
    assert report.steps == CFG.steps and all(np.isfinite(_losses(root / "cached-topk-8")))


def test_killed_cache_training_resumes_bit_identical(env, tmp_path):
    target, _ = env["llama"]
    cache = _capture(env, "llama", "fp8")
    cfg = CFG.replace(steps=6, save_every=1, eval_every=6)
    ref = train(TrainOptions(target, None, str(tmp_path / "ref"), config=cfg, progress=False, cache=cache))
    out = tmp_path / "killed"
    code = ("import sys; from outrider.train.loop.trainer import train; from outrider.config import TrainConfig; "
            "from outrider.train.options import TrainOptions; "
            "train(TrainOptions(sys.argv[1], None, sys.argv[2], config=TrainConfig.load(sys.argv[3]), progress=False, "
            "cache=sys.argv[4]))")
    cfg_path = cfg.save(tmp_path / "cfg.json")
    killed_at = kill_training_after(code, [target, str(out), str(cfg_path), cache], out)
    assert 2 <= killed_at < cfg.steps
    report = train(TrainOptions(target, None, str(out), resume=True, progress=False, cache=cache))
    assert report.resumed_from == killed_at and report.steps == ref.steps
    a = load_file(str(tmp_path / "ref" / "last" / "head" / "model.safetensors"))
    b = load_file(str(out / "last" / "head" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_processes_split_a_cache_and_match_one(env, tmp_path):
    target, _ = env["llama"]
    cache = _capture(env, "llama", "bf16")
    base = CFG.replace(steps=2, eval_every=2, save_every=2, group_by_length=8)
    cfg = base.save(tmp_path / "two.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "outrider",
           "train", target, "--cache", cache, "--out", str(tmp_path / "two"), "--config", str(cfg), "--device", "cpu",
           "--quiet"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    train(TrainOptions(target, None, str(tmp_path / "one"), config=base.replace(batch_size=4), progress=False,
                       cache=cache))
    assert np.allclose(_losses(tmp_path / "one"), _losses(tmp_path / "two"), rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Capture: resume after SIGKILL, refusals, disk full


def test_killed_capture_resumes_without_rewriting_finished_shards(env, tmp_path):
    target, data = env["llama"]
    straight = Path(_capture(env, "llama", "float32"))
    out = tmp_path / "killed"
    code = ("import sys, time\nfrom outrider.train.states import cache\n"
            "from outrider.train.states.cache_capture import capture_cache\n"
            "write = cache._write_file\n"
            "def slow(path, data):\n    write(path, data); time.sleep(0.3)\n"
            "cache._write_file = slow\n"
            "capture_cache(sys.argv[1], sys.argv[2], sys.argv[3], dtype='float32', aux_layer_ids=(1, 2, 3), "
            "max_tokens_per_shard=300, progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", code, target, data, str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    manifest = out / "manifest.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 2:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("shard-*")}
    assert 2 <= len(finished) < json.loads((out / "header.json").read_text())["shards"]
    with pytest.raises(UserError, match="incomplete"):
        OutriderCache(out)
    report = capture_cache(target, data, str(out), dtype="float32", aux_layer_ids=AUX, max_tokens_per_shard=300,
                           progress=False)
    assert report.shards_written == report.shards - len(finished)
    for name, stamp in finished.items():  # never rewritten
        p = out / name
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == stamp
    assert _digest(out) == _digest(straight)  # the same bytes as a capture never interrupted
    assert not list(out.glob(".*tmp"))
    again = capture_cache(target, data, str(out), dtype="float32", aux_layer_ids=AUX, max_tokens_per_shard=300,
                          progress=False)
    assert again.shards_written == 0


def test_a_shard_renamed_but_not_listed_is_adopted_not_rewritten(env, tmp_path):
    target, data = env["llama"]
    out = _copy(_capture(env, "llama", "fp8"), tmp_path / "c")
    m = json.loads((out / "manifest.json").read_text())
    last = out / m["shards"][-1]["file"]
    stamp = (last.stat().st_ino, last.stat().st_mtime_ns)
    (out / "manifest.json").write_text(json.dumps({**m, "complete": False, "shards": m["shards"][:-1]}))
    (out / ".shard-00001.safetensors.abc.tmp").write_bytes(b"half a shard")  # a killed write's leftover
    report = capture_cache(target, data, str(out), dtype="fp8", aux_layer_ids=AUX, max_tokens_per_shard=300,
                           progress=False)
    assert report.shards_written == 0 and (last.stat().st_ino, last.stat().st_mtime_ns) == stamp
    assert json.loads((out / "manifest.json").read_text()) == m and not list(out.glob(".*tmp"))


def test_disk_full_mid_shard_keeps_finished_shards(env, tmp_path, monkeypatch, capsys):
    target, data = env["llama"]
    out = tmp_path / "full"
    write, calls = cache_mod._write_file, []

    def full(path, blob):
        calls.append(path)
        if len(calls) == 3:
            with open(path, "wb") as f:
                f.write(blob[: len(blob) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, blob)

    monkeypatch.setattr(cache_mod, "_write_file", full)
    args = ["capture", target, "--data", data, "--out", str(out), "--dtype", "fp8", "--aux-layers", "1,2,3",
            "--max-tokens-per-shard", "300", "--device", "cpu", "--quiet"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "disk is full" in err and "2 finished shard(s) are kept" in err and len(err.splitlines()) == 1
    kept = _digest(out)
    assert len(kept) == 2 and not list(out.glob(".*tmp"))
    monkeypatch.setattr(cache_mod, "_write_file", write)
    assert cli_main(args) == 0
    assert {k: v for k, v in _digest(out).items() if k in kept} == kept
    OutriderCache(out).read("train", 0)


def test_capture_refusals_are_one_line(env, tmp_path, capsys):
    target, data = env["llama"]
    cache = _capture(env, "llama", "bf16")
    for args, words in (
        (["capture", target, "--data", data, "--out", cache, "--dtype", "fp8", "--aux-layers", "1,2,3",
          "--max-tokens-per-shard", "300"], "other settings (dtype"),
        (["capture", target, "--data", data, "--out", str(tmp_path / "x"), "--aux-layers", "1,2,9"], "three distinct"),
        (["capture", env["deepseek_v3"][0], "--data", str(tmp_path / "nodata"), "--out", str(tmp_path / "y"),
          "--aux-layers", "1,2,3"], "not an outrider token dataset"),
    ):
        assert cli_main(args) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err


def test_data_without_loss_tokens_is_refused(env, tmp_path):
    from outrider.train.data.datasets import read_manifest, write_dataset

    target, data = env["llama"]
    manifest = read_manifest(data)
    rows = {"train": [("a", [1, 5, 6, 7], [0, 0, 0, 0])], "eval": []}
    write_dataset(tmp_path / "empty", {**manifest, "splits": {}}, rows, 8)
    with pytest.raises(UserError, match="no loss tokens"):
        capture_cache(target, str(tmp_path / "empty"), str(tmp_path / "c"), aux_layer_ids=AUX, progress=False)


# ---------------------------------------------------------------------------------------------
# Training from a bad cache: one line, exit 2


def _copy(src: str, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_bad_caches_are_one_line_errors(env, tmp_path, capsys):
    target, _ = env["llama"]
    good = _capture(env, "llama", "fp8")
    cfg = CFG.save(tmp_path / "cfg.json")

    def run(cache: Path | str, *extra: str, tgt: str = target) -> str:
        code = cli_main(["train", tgt, "--cache", str(cache), "--out", str(tmp_path / f"o{time.monotonic_ns()}"),
                         "--config", str(cfg), "--quiet", *extra])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        return err

    truncated = _copy(good, tmp_path / "truncated")
    shard = sorted(truncated.glob("shard-*"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    assert "truncated" in run(truncated)
    for name, where, words in (("states", "aux_offset", "sha256 mismatch"), ("tokens", None, "tokens fail")):
        corrupt = _copy(good, tmp_path / f"corrupt-{name}")
        m = json.loads((corrupt / "manifest.json").read_text())
        for entry in m["shards"]:  # one flipped byte in every shard: in its aux states, or in its tokens
            shard = corrupt / entry["file"]
            blob = bytearray(shard.read_bytes())
            at = entry["examples"][where][-1] + 1 if where else entry["examples"]["aux_offset"][0] - 2
            blob[at] ^= 0xFF
            shard.write_bytes(bytes(blob))
        assert words in run(corrupt)
    other = save_tiny("llama", tmp_path / "other", seed=1)  # same config and tokenizer, other weights
    capsys.readouterr()
    assert "another target (weights" in run(good, tgt=str(other))
    assert "holds aux layers [1, 2, 3], not [0, 1, 2]" in run(good, "--aux-layers", "0,1,2")
    assert "not a hidden-state cache" in run(tmp_path / "other")
    assert "either --data" in run(good, "--data", env["llama"][1])
    incomplete = _copy(good, tmp_path / "incomplete")
    m = json.loads((incomplete / "manifest.json").read_text())
    (incomplete / "manifest.json").write_text(json.dumps({**m, "complete": False, "shards": m["shards"][:-1]}))
    assert "incomplete" in run(incomplete)


@pytest.mark.slow
def test_default_model_cache_training_equals_online_training(tmp_path, monkeypatch):
    from outrider import assets

    if not (assets.default_model_dir() / "config.json").exists() or not assets.sharegpt_path().exists():
        pytest.skip("default model or ShareGPT not pulled (run `outrider pull`)")
    data = tmp_path / "data"
    build_dataset("default", "sharegpt", str(data), max_conversations=6, max_length=96, eval_fraction=0.34,
                  progress=False)
    cfg = TrainConfig.preset("quick").replace(steps=2, warmup_steps=1, batch_size=2, max_length=96, eval_every=2,
                                              save_every=2, eval_examples=2, draft_vocab_size=512)
    online = train(TrainOptions("default", str(data), str(tmp_path / "online"), config=cfg, progress=False))
    report = capture_cache("default", str(data), str(tmp_path / "cache"), dtype="float32", device="cpu",
                           progress=False)
    assert report.bytes_per_token < 8 * 576 * 4  # float32: the final state at teacher rows only

    def refuse(*a, **k):
        raise AssertionError("training from a cache built the target")

    monkeypatch.setattr("outrider.models.load_model", refuse)
    cached = train(TrainOptions("default", None, str(tmp_path / "cached"), config=cfg, progress=False,
                                cache=str(tmp_path / "cache")))
    assert np.allclose(_losses(tmp_path / "online"), _losses(tmp_path / "cached"), rtol=1e-5, atol=0)
    assert cached.final_eval["loss"] == pytest.approx(online.final_eval["loss"], rel=1e-5)
