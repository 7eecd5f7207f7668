"""Training a DFlash drafter end to end through the command line: ``train --drafter dflash`` (GQA and
MLA targets), exact resume, the saved drafter benches losslessly with ``--method dflash`` and
exports for the engines; what does not fit is refused in one line."""

from __future__ import annotations

import json

import pytest
from test_trainer import CFG, _conversations
from tiny import save_tiny

from outrider.cli import main as cli_main
from outrider.interop.checkpoint import load_head
from outrider.train.data.prepare import build_dataset

DFLASH = {**CFG.to_dict(), "steps": 6, "eval_every": 3, "save_every": 3, "block_size": 4, "dflash_layers": 2,
          "num_anchors": 8, "tau_k": 3}


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def env(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"dflash-{request.param}")
    target = save_tiny(request.param, root / "tiny")
    data = root / "data"
    build_dataset(str(target), str(_conversations(root / "a.json", 24, 0, 5, 60)), str(data), eval_fraction=0.2,
                  progress=False)
    config = root / "cfg.json"
    config.write_text(json.dumps(DFLASH))
    return {"root": root, "target": str(target), "data": str(data), "config": str(config)}


def _train(env, out, *extra):
    settings = [] if "--resume" in extra else ["--config", env["config"]]
    return cli_main(["train", env["target"], "--data", env["data"], "--out", str(out), *settings,
                     "--drafter", "dflash", "--quiet", "--device", "cpu", *extra])


def test_a_resumed_run_equals_one_never_interrupted(env, capsys):
    whole, split = env["root"] / "whole", env["root"] / "split"
    assert _train(env, whole) in (0, None), capsys.readouterr().err
    assert _train(env, split, "--max-steps", "4") in (0, None), capsys.readouterr().err
    assert _train(env, split, "--resume") in (0, None), capsys.readouterr().err
    a, cfg = load_head(whole / "last" / "head", env["target"])
    b, _ = load_head(split / "last" / "head", env["target"])
    assert cfg.block_size == 4 and cfg.num_hidden_layers == 2 and cfg.mask_token_id == 0  # the tokenizer's <pad>
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert (x == y).all(), name
    evals = [r for r in map(json.loads, (whole / "metrics.jsonl").read_text().splitlines()) if r["type"] == "eval"]
    assert evals and len(evals[-1]["per_step_acc"]) == 3 and "walk_tau_k" in evals[-1]
    losses = [r["loss"] for r in map(json.loads, (whole / "metrics.jsonl").read_text().splitlines())
              if r["type"] == "train"]
    assert losses[-1] < losses[0]


def test_the_trained_drafter_benches_losslessly_and_exports(env, tmp_path, capsys):
    run = env["root"] / "whole"
    if not (run / "head" / "config.json").exists():
        assert _train(env, run) in (0, None)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7 w5 w6 w7\nw9 w10 w11 w12 w9 w10\n")
    out = tmp_path / "bench.json"
    rc = cli_main(["bench", env["target"], "--method", "dflash", "--draft", str(run / "head"), "--k", "3",
                   "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "12", "--json", str(out)])
    assert rc in (0, None), capsys.readouterr().err
    (record,) = json.loads(out.read_text())
    assert record["method"] == "dflash" and record["lossless"] is True and len(record["accept_rate_per_pos"]) == 3
    rc = cli_main(["export", str(run / "head"), "--format", "vllm", "--out", str(tmp_path / "x"),
                   "--num-speculative-tokens", "3"])
    assert rc in (0, None), capsys.readouterr().err
    said = capsys.readouterr().out
    assert "DFlash checkpoint" in said and "target_layer_ids" in said
    raw = json.loads((tmp_path / "x" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["torch_dtype"] == "bfloat16"
    rc = cli_main(["export", str(run / "head"), "--format", "speculators", "--out", str(tmp_path / "y")])
    assert rc in (0, None), capsys.readouterr().err
    raw = json.loads((tmp_path / "y" / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash" and raw["speculators_config"]["verifier"]["name_or_path"]


def test_refusals(env, tmp_path, capsys):
    run = env["root"] / "whole"
    if not (run / "head" / "config.json").exists():
        assert _train(env, run) in (0, None)
    prompts = tmp_path / "p.txt"
    prompts.write_text("w5 w6 w7\n")
    common = ["--prompts", str(prompts), "--num-prompts", "1", "--max-new-tokens", "4"]
    assert cli_main(["bench", env["target"], "--method", "eagle3", "--draft", str(run / "head"), *common]) == 2
    assert "--method dflash" in capsys.readouterr().err
    assert cli_main(["bench", env["target"], "--method", "dflash", "--draft", str(run / "head"), "--k", "4",
                     *common]) == 2
    assert "at most 3" in capsys.readouterr().err
    assert cli_main(["train", env["target"], "--data", env["data"], "--out", str(run), "--resume",
                     "--drafter", "eagle3", "--quiet", "--device", "cpu"]) == 2
    assert "trains a dflash drafter" in capsys.readouterr().err


def test_dflash_reads_any_number_of_aux_layers_and_refuses_an_init(env, capsys):
    out = env["root"] / "four"
    assert _train(env, out, "--aux-layers", "1,2,3,4", "--max-steps", "1") in (0, None), capsys.readouterr().err
    drafter, cfg = load_head(out / "head", env["target"])
    assert cfg.aux_layer_ids == (1, 2, 3, 4) and drafter.fc.in_features == 4 * cfg.target_hidden_size
    assert cli_main(["train", env["target"], "--data", env["data"], "--out", str(env["root"] / "init"),
                     "--init", str(out / "head"), "--quiet", "--device", "cpu"]) == 2
    assert "is a DFlash drafter" in capsys.readouterr().err


def test_a_frozen_lm_head_stays_the_targets_rows(env, capsys):
    """``freeze_lm_head`` (with ``init_from_target``): the drafter's lm_head is the target's rows of the
    draft vocabulary after training, where the same run unfrozen moves them; without the start, refused."""
    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(env["target"], dtype=torch.float32)
    heads = {}
    for frozen in (True, False):
        cfg = env["root"] / f"init-{frozen}.json"
        cfg.write_text(json.dumps({**DFLASH, "init_from_target": True, "freeze_lm_head": frozen}))
        out = env["root"] / f"frozen-{frozen}"
        rc = cli_main(["train", env["target"], "--data", env["data"], "--out", str(out), "--config", str(cfg),
                       "--drafter", "dflash", "--quiet", "--device", "cpu", "--max-steps", "2"])
        assert rc in (0, None), capsys.readouterr().err
        heads[frozen] = load_head(out / "head", env["target"])[0]
    drafter = heads[True]
    ids = torch.arange(drafter.d2t.numel()) + drafter.d2t  # [draft_vocab] target ids
    rows = target.get_output_embeddings().weight[ids]  # [draft_vocab, H]
    assert torch.equal(drafter.lm_head.weight.float(), rows)
    assert not torch.equal(heads[False].lm_head.weight.float(), rows)
    bad = env["root"] / "bad.json"
    bad.write_text(json.dumps({**DFLASH, "freeze_lm_head": True}))
    assert cli_main(["train", env["target"], "--data", env["data"], "--out", str(env["root"] / "bad"),
                     "--config", str(bad), "--drafter", "dflash", "--quiet", "--device", "cpu"]) == 2
    assert "set init_from_target too" in capsys.readouterr().err


def test_a_drafter_with_its_own_kv_heads_trains_and_a_non_divisor_is_refused(env, capsys):
    """``dflash_kv_heads`` reaches the saved drafter (one key/value head on either tiny target, whose
    4 heads have 2 (Llama) or 4 (MLA: the drafter's plain attention)); 3 does not divide 4: one line,
    exit 2, no run written."""
    cfg = env["root"] / "kv1.json"
    cfg.write_text(json.dumps({**DFLASH, "dflash_kv_heads": 1}))
    out = env["root"] / "kv1"
    rc = cli_main(["train", env["target"], "--data", env["data"], "--out", str(out), "--config", str(cfg),
                   "--drafter", "dflash", "--quiet", "--device", "cpu", "--max-steps", "2"])
    assert rc in (0, None), capsys.readouterr().err
    assert load_head(out / "head", env["target"])[1].num_key_value_heads == 1
    cfg.write_text(json.dumps({**DFLASH, "dflash_kv_heads": 3}))
    bad = env["root"] / "kv3"
    assert cli_main(["train", env["target"], "--data", env["data"], "--out", str(bad), "--config", str(cfg),
                     "--drafter", "dflash", "--quiet", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "dflash_kv_heads 3) must divide its 4 attention heads" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err  # under --quiet no loader bar either
    assert not (bad / "head").exists()


def test_dflash_labels_are_tokens_or_the_target():
    from outrider.config import TrainConfig
    from outrider.errors import UserError

    assert TrainConfig(drafter="dflash", dflash_labels="target").dflash_labels == "target"
    with pytest.raises(UserError, match="'dflash_labels' must be one of tokens, target"):
        TrainConfig(drafter="dflash", dflash_labels="soft")
    with pytest.raises(UserError, match="'dflash_labels' is a DFlash drafter's"):
        TrainConfig(dflash_labels="target")  # an EAGLE-3 head


def test_dflash_kv_heads_are_the_drafters_own_or_the_targets():
    from outrider.config import TrainConfig
    from outrider.errors import UserError

    assert TrainConfig(drafter="dflash").dflash_kv_heads == 0  # the target's layout
    assert TrainConfig(drafter="dflash", dflash_kv_heads=4).dflash_kv_heads == 4
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(UserError, match="'dflash_kv_heads' must be an integer >= 0"):
            TrainConfig(drafter="dflash", dflash_kv_heads=bad)
    with pytest.raises(UserError, match="'dflash_kv_heads' is a DFlash drafter's"):
        TrainConfig(dflash_kv_heads=4)  # an EAGLE-3 head


def test_a_settings_file_of_a_dflash_drafter_with_the_flag_alone(tmp_path):
    """``--config`` naming DFlash settings (soft labels) and ``--drafter dflash`` naming the drafter:
    the flag applies before the settings are checked together, on a new run and on a resume."""
    from outrider.config import TrainConfig, resolve_config
    from outrider.errors import UserError
    from outrider.train.loop.resume import settings

    path = tmp_path / "soft.json"
    path.write_text(json.dumps({"block_size": 4, "dflash_labels": "target"}))
    cfg, preset = resolve_config("quick", str(path), "cpu", "dflash")
    assert (cfg.drafter, cfg.dflash_labels, cfg.block_size, preset) == ("dflash", "target", 4, "quick")
    assert resolve_config("quick", None, "cpu", "dflash")[0].drafter == "dflash"
    with pytest.raises(UserError, match="'dflash_labels' is a DFlash drafter's"):
        resolve_config("quick", str(path), "cpu")  # no flag: the settings name an EAGLE-3 head
    state = {"config": cfg.to_dict(), "world_size": 1, "preset": "quick"}
    assert settings(state, "quick", str(path), None, None, 1, "cpu", "dflash")[0] == cfg
    given = TrainConfig.preset("quick")  # a library caller's TrainConfig takes the flag as a file does
    assert resolve_config(None, given, "cpu", "dflash")[0] == given.replace(drafter="dflash")


def test_a_frozen_lm_head_needs_the_targets_rows(tiny_models):
    """``init_from_target(need_rows=True)``: a target side with no rows of the head's width is refused
    (a frozen random lm_head would train nothing); without the need the rows are skipped."""
    import torch
    from test_dflash import random_drafter

    from outrider.errors import UserError
    from outrider.train.loop.head_init import init_from_target

    drafter = random_drafter(tiny_models("llama"))
    before = drafter.lm_head.weight.clone()

    class NoRows:
        def lm_rows(self, ids):
            return None

        def norm_weight(self):
            return None

    init_from_target(drafter, NoRows(), torch.arange(4))
    assert torch.equal(drafter.lm_head.weight, before)
    with pytest.raises(UserError, match="freeze_lm_head needs the target's lm_head rows"):
        init_from_target(drafter, NoRows(), torch.arange(4), need_rows=True)
