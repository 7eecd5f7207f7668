"""--stream-layers for capture and training: the streamed cache, its resume after SIGKILL, streamed online
training against training from a cache of the same passes, exact resume, one-line refusals."""

from __future__ import annotations

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
from test_trainer import _conversations
from tiny import save_tiny

from outrider.cli import main as cli_main
from outrider.config import TrainConfig
from outrider.train.data.prepare import build_dataset
from outrider.train.loop.trainer import train
from outrider.train.options import StreamOptions, TrainOptions
from outrider.train.states.cache import OutriderCache
from outrider.train.states.cache_capture import capture_cache
from outrider.train.states.stream import StreamedTarget

CFG = TrainConfig(steps=4, batch_size=2, grad_accum=2, max_length=48, lr=3e-3, warmup_steps=1, ttt_steps=3,
                  draft_vocab_size=40, eval_every=2, save_every=2, eval_examples=4, log_every=1,
                  aux_layer_ids=(1, 2, 3))
ONE = {"max_chunk_tokens": 1, "tokens_per_pass": 160}  # one example per chunk: states independent of grouping


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream_train")
    target = save_tiny("deepseek_v3", root / "dsv3")
    data = root / "data"
    build_dataset(str(target), str(_conversations(root / "a.json", 20, 0, 5, 60)), str(data), eval_fraction=0.2,
                  progress=False)
    return {"root": root, "target": str(target), "data": str(data)}


def _losses(out: Path, kind: str = "train") -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("shard-*"))}


def test_streamed_capture_cli_and_its_cache(env, tmp_path):
    plain, streamed = tmp_path / "plain", tmp_path / "streamed"
    common = ["capture", env["target"], "--data", env["data"], "--dtype", "float32", "--aux-layers", "1,2,3",
              "--max-tokens-per-shard", "300", "--device", "cpu", "--quiet"]
    assert cli_main(common + ["--out", str(plain)]) == 0
    assert cli_main(common + ["--out", str(streamed), "--stream-layers", "--tokens-per-pass", "200"]) == 0
    a, b = OutriderCache(plain), OutriderCache(streamed)
    for split in a.splits():
        assert len(a.examples(split)[0]) == len(b.examples(split)[0])
        for i in range(len(a.examples(split)[0])):
            x, y = a.read(split, i), b.read(split, i)
            # the same states up to float32 rounding (batched differently), the same teacher rows
            assert np.allclose(x.aux.numpy(), y.aux.numpy(), atol=1e-5) and (x.rows == y.rows).all()
            assert np.allclose(x.final.numpy(), y.final.numpy(), atol=1e-5)


def test_killed_streamed_capture_resumes_bit_identical(env, tmp_path):
    straight = tmp_path / "straight"
    capture_cache(env["target"], env["data"], str(straight), dtype="float32", aux_layer_ids=(1, 2, 3),
                  max_tokens_per_shard=300, progress=False,
                  source=StreamedTarget(env["target"], (1, 2, 3), device="cpu", tokens_per_pass=200))
    out = tmp_path / "killed"
    code = ("import sys, time; from outrider.train.states import cache\n"
            "from outrider.train.states.cache_capture import capture_cache\n"
            "from outrider.train.states.stream import StreamedTarget\n"
            "write = cache._write_file\n"
            "def slow(path, data):\n    write(path, data); time.sleep(0.5)\n"
            "cache._write_file = slow\n"
            "capture_cache(sys.argv[1], sys.argv[2], sys.argv[3], dtype='float32', aux_layer_ids=(1, 2, 3), "
            "max_tokens_per_shard=300, progress=False, "
            "source=StreamedTarget(sys.argv[1], (1, 2, 3), device='cpu', tokens_per_pass=200))")
    proc = subprocess.Popen([sys.executable, "-c", code, env["target"], env["data"], str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    manifest = out / "manifest.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 1:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert 1 <= len(finished) < json.loads((out / "header.json").read_text())["shards"]
    assert cli_main(["capture", env["target"], "--data", env["data"], "--out", str(out), "--dtype", "float32",
                     "--aux-layers", "1,2,3", "--max-tokens-per-shard", "300", "--device", "cpu", "--quiet",
                     "--stream-layers", "--tokens-per-pass", "200"]) == 0
    assert all((out / n).stat().st_mtime_ns == t for n, t in finished.items())  # never rewritten
    assert _digest(out) == _digest(straight)  # the same bytes as a streamed capture never interrupted


def test_streamed_training_equals_training_from_the_cache_of_its_passes(env, tmp_path):
    cache = tmp_path / "cache"
    capture_cache(env["target"], env["data"], str(cache), dtype="float32", aux_layer_ids=(1, 2, 3),
                  max_tokens_per_shard=300, progress=False,
                  source=StreamedTarget(env["target"], (1, 2, 3), device="cpu", **ONE))
    from_cache = train(TrainOptions(env["target"], None, str(tmp_path / "c"), config=CFG, progress=False,
                                    cache=str(cache), device="cpu"))
    streamed = train(TrainOptions(env["target"], env["data"], str(tmp_path / "s"), config=CFG, progress=False,
                                  device="cpu", stream=StreamOptions(**ONE)))
    assert len(_losses(tmp_path / "s")) == CFG.steps
    assert _losses(tmp_path / "s") == _losses(tmp_path / "c")
    assert _losses(tmp_path / "s", "eval") == _losses(tmp_path / "c", "eval")
    assert streamed.best_sim_tau == from_cache.best_sim_tau


def test_streamed_training_resumes_bit_identical(env, tmp_path):
    options = {"tokens_per_pass": 120}  # passes of several batches, chunks of several examples
    straight = train(TrainOptions(env["target"], env["data"], str(tmp_path / "a"), config=CFG, progress=False,
                                  device="cpu", stream=StreamOptions(**options)))
    train(TrainOptions(env["target"], env["data"], str(tmp_path / "b"), config=CFG, progress=False, device="cpu",
                       stream=StreamOptions(**options), max_steps=3))
    resumed = train(TrainOptions(env["target"], env["data"], str(tmp_path / "b"), resume=True, progress=False,
                                 device="cpu", stream=StreamOptions(**options)))
    assert _losses(tmp_path / "b") == _losses(tmp_path / "a")
    assert resumed.best_sim_tau == straight.best_sim_tau


def test_streaming_flags_are_checked(env, tmp_path, capsys):
    base = ["train", env["target"], "--data", env["data"], "--out", str(tmp_path / "o"), "--device", "cpu", "--quiet"]
    for extra, match in [(["--stream-layers", "--gpu-memory", "0.0001"], "too small for layer streaming"),
                         (["--gpu-memory", "8"], "add --stream-layers"),
                         (["--stream-layers", "--device-map", "auto"], "give one")]:
        assert cli_main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert match in err and "\n" not in err and "Traceback" not in err
