"""Training a P-EAGLE head: ``--parallel-drafting``, the placeholder token from the tokenizer, the
saved head reloads as parallel, resume keeps (and checks) the setting."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from test_trainer import CFG, _conversations
from tiny import save_tiny

from outrider.cli import main as cli_main
from outrider.errors import UserError
from outrider.interop.checkpoint import load_head
from outrider.train.data.prepare import build_dataset
from outrider.train.loop.head_init import mask_token_id
from outrider.train.loop.trainer import train
from outrider.train.options import TrainOptions


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("ptrain")
    target = save_tiny("llama", root / "tiny")
    data = root / "data"
    build_dataset(str(target), str(_conversations(root / "a.json", 24, 0, 5, 60)), str(data), eval_fraction=0.2,
                  progress=False)
    config = root / "cfg.json"
    config.write_text(json.dumps({**CFG.to_dict(), "steps": 4, "eval_every": 4, "save_every": 2}))
    return {"root": root, "target": str(target), "data": str(data), "config": str(config)}


def test_mask_token_id_falls_back_pad_unk_eos():
    assert mask_token_id(SimpleNamespace(pad_token_id=7, unk_token_id=8, eos_token_id=9)) == 7
    assert mask_token_id(SimpleNamespace(pad_token_id=None, unk_token_id=8, eos_token_id=9)) == 8
    assert mask_token_id(SimpleNamespace(pad_token_id=None, unk_token_id=None, eos_token_id=[9, 10])) == 9
    with pytest.raises(UserError, match="mask_token_id"):
        mask_token_id(SimpleNamespace(pad_token_id=None, unk_token_id=None, eos_token_id=None))


def test_cli_trains_a_parallel_head_and_resumes_it(env, capsys):
    out = env["root"] / "run"
    rc = cli_main(["train", env["target"], "--data", env["data"], "--out", str(out), "--config", env["config"],
                   "--parallel-drafting", "--max-steps", "2", "--quiet", "--device", "cpu"])
    assert rc in (0, None), capsys.readouterr().err
    rc = cli_main(["train", env["target"], "--data", env["data"], "--out", str(out), "--resume",
                   "--parallel-drafting", "--quiet", "--device", "cpu"])
    assert rc in (0, None), capsys.readouterr().err
    head, cfg = load_head(out / "head", env["target"])
    assert cfg.parallel_drafting and cfg.mask_token_id == 0  # the tiny tokenizer's <pad>
    assert head.mask_hidden is not None and head.mask_hidden.shape == (1, 3 * cfg.target_hidden_size)
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "eval"]
    assert evals and "walk_tau_k" in evals[-1] and "sim_tau_k" in evals[-1]


def test_resuming_an_eagle3_run_as_parallel_is_refused(env):
    out = env["root"] / "plain"
    train(TrainOptions(env["target"], env["data"], str(out), config=env["config"], max_steps=2, progress=False))
    with pytest.raises(UserError, match="--parallel-drafting"):
        train(TrainOptions(env["target"], env["data"], str(out), resume=True, parallel_drafting=True, progress=False))
