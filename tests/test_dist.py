"""Distributed training on CPU: torchrun + gloo with 2 processes equals 1 process with the same global batch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import _conversations
from tiny import save_tiny

from outrider.config import TrainConfig
from outrider.errors import UserError
from outrider.train.data.prepare import build_dataset
from outrider.train.loop import dist
from outrider.train.loop.trainer import train
from outrider.train.options import TrainOptions


def test_single_process_env_without_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    env = dist.init_from_env("cpu")
    assert (env.rank, env.world_size, env.backend, env.is_main, env.distributed) == (0, 1, None, True, False)
    t = torch.tensor([3.0])
    assert dist.all_reduce_sum(t, env) is t and float(t) == 3.0
    module = torch.nn.Linear(2, 2)
    assert dist.wrap(module, env) is module and dist.unwrap(module) is module
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(UserError, match="WORLD_SIZE"):
        dist.init_from_env("cpu")
    with pytest.raises(UserError, match="FSDP2"):
        dist.shard_head(module, env)


def test_gloo_two_processes_match_one_process(tmp_path):
    target = save_tiny("llama", tmp_path / "tiny")
    data = tmp_path / "data"
    build_dataset(str(target), str(_conversations(tmp_path / "c.json", 24, 3, 5, 70)), str(data), eval_fraction=0.2,
                  progress=False)
    # global batch 8 = 2 sequences x 2 processes x 2 accumulation steps = 4 x 1 process x 2
    base = TrainConfig(steps=4, batch_size=2, grad_accum=2, max_length=40, lr=2e-3, warmup_steps=1, ttt_steps=3,
                       draft_vocab_size=40, eval_every=2, save_every=2, eval_examples=4, aux_layer_ids=(1, 2, 3),
                       group_by_length=8)  # length-grouped batches, as the presets use
    two_cfg = base.save(tmp_path / "two.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "outrider",
           "train", str(target), "--data", str(data), "--out", str(tmp_path / "two"), "--config", str(two_cfg),
           "--device", "cpu", "--quiet"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("trained 4/4 steps on cpu x2 (global batch 8") == 1  # rank 0 alone prints

    one = train(TrainOptions(str(target), str(data), str(tmp_path / "one"), config=base.replace(batch_size=4),
                             progress=False))
    assert one.global_batch == 8

    a = load_file(str(tmp_path / "one" / "last" / "head" / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "last" / "head" / "model.safetensors"))
    for k in a:  # Adam divides by sqrt(v): an entry whose gradient is ~0 can amplify float noise to ~lr,
        # so the bound is on the whole tensor (a wrong batch or reduction moves it by ~lr everywhere)
        diff = a[k].float() - b[k].float()
        assert float(diff.norm()) <= 1e-4 * float(a[k].float().norm()) and float(diff.abs().max()) < 2e-4, k
    rec = {}
    for run in ("one", "two"):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        rec[run] = [json.loads(x) for x in lines if json.loads(x)["type"] == "train"]
    assert [r["step"] for r in rec["two"]] == [1, 2, 3, 4]  # one writer
    assert [r["positions"] for r in rec["one"]] == [r["positions"] for r in rec["two"]]
    for r1, r2 in zip(rec["one"], rec["two"]):
        assert r1["loss"] == pytest.approx(r2["loss"], rel=1e-4)
