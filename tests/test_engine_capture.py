"""Capture through vLLM (the engine tier): hidden states from a real vLLM into our cache, equal to our
own capture in float32, and its faults (the server gone mid-run) kept to one line and resumable.

The equality runs on the default target (SmolLM2-135M) and 24 ShareGPT conversations; the fault
runs on a randomly initialised target at the shapes vLLM's CPU kernels take (``permuted.save_random``). vLLM's ids are asked for as
the aux ids plus ``L``; the equality of every stored state with the in-memory capture (which reads
Hugging Face's ``output_hidden_states``) is what checks that vLLM's id ``j`` is the state entering
layer ``j`` and ``L`` the last layer's output before the final norm.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import engine_env
import permuted
from test_trainer import _conversations

from outrider.cli import main
from outrider.config import TrainConfig
from outrider.errors import UserError
from outrider.train.data.prepare import build_dataset
from outrider.train.states.cache import OutriderCache
from outrider.train.states.cache_capture import capture_cache
from outrider.train.states.engine_source import EngineSource, extraction_args, outrider_root

pytestmark = pytest.mark.engine

AUX = (2, 4, 5)


def _capture_ours(target: str, data: Path, out: Path) -> float:
    """Our in-memory capture (float32); its tokens/s."""
    t0 = time.perf_counter()
    report = capture_cache(target, str(data), str(out), dtype="float32", aux_layer_ids=AUX, max_tokens_per_shard=400,
                           progress=False, device="cpu")
    return report.tokens / (time.perf_counter() - t0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random target at vLLM's CPU shapes, tiny conversations and our capture of them."""
    root = tmp_path_factory.mktemp("engine_capture")
    target = permuted.save_random("llama", root / "target", seed=5)
    data = root / "data"
    build_dataset(str(target), str(_conversations(root / "c.json", 24, 1, 5, 60)), str(data), eval_fraction=0.2,
                  progress=False)
    ours = root / "ours"
    return {"root": root, "target": target, "data": data, "ours": ours, "ours_tps": _capture_ours(str(target), data, ours)}


@pytest.fixture(scope="module")
def default_setup(tmp_path_factory):
    """The default target (SmolLM2-135M), 24 ShareGPT conversations, our capture of them."""
    from outrider import assets

    if not (assets.default_model_dir() / "config.json").exists():
        pytest.skip("default model not pulled (run `outrider pull`)")
    root = tmp_path_factory.mktemp("engine_capture_default")
    data = root / "data"
    assert main(["data", "default", "--dataset", "sharegpt", "--out", str(data), "--max-conversations", "24",
                 "--max-length", "256", "--quiet"]) == 0
    ours = root / "ours"
    return {"root": root, "target": "default", "data": data, "ours": ours,
            "ours_tps": _capture_ours("default", data, ours)}


def _max_differences(a: Path, b: Path) -> tuple[list[float], float, int, list[float]]:
    """Per aux state, the largest |a - b| over every stored token relative to the largest |a|; the
    same for the teacher rows (the final normed state)."""
    ca, cb = OutriderCache(str(a)), OutriderCache(str(b))
    diff, scale, tokens = [0.0] * (len(AUX) + 1), [0.0] * (len(AUX) + 1), 0
    for split in ca.splits():
        ids_a, _, _ = ca.examples(split)
        ids_b, _, _ = cb.examples(split)
        assert [x.tolist() for x in ids_a] == [x.tolist() for x in ids_b]
        for i in range(len(ids_a)):
            sa, sb = ca.read(split, i), cb.read(split, i)
            pairs = [(sa.aux[:, j], sb.aux[:, j]) for j in range(len(AUX))] + [(sa.final, sb.final)]
            for j, (x, y) in enumerate(pairs):
                diff[j] = max(diff[j], (x.float() - y.float()).abs().max().item())
                scale[j] = max(scale[j], x.float().abs().max().item())
            tokens += len(ids_a[i])
    rel = [d / s for d, s in zip(diff, scale)]
    return rel[:-1], rel[-1], tokens, diff


def _engine_env(monkeypatch, vllm: Path) -> None:
    """This process's environment as the engine's (only the server, a child, runs under it)."""
    for key, value in engine_env.environ(vllm).items():
        if key in ("PATH", "LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "VLLM_TARGET_DEVICE"):
            monkeypatch.setenv(key, value)


def test_engine_capture_equals_ours_and_trains(vllm, default_setup, monkeypatch, tmp_path):
    """On the default target in float32: every stored state equal to our capture's, and training from
    either cache gives the same losses."""
    setup = default_setup
    _engine_env(monkeypatch, vllm)
    out = setup["root"] / "engine"
    t0 = time.perf_counter()
    rc = main(["capture", str(setup["target"]), "--data", str(setup["data"]), "--out", str(out), "--dtype", "float32",
               "--aux-layers", ",".join(map(str, AUX)), "--max-tokens-per-shard", "400", "--engine", "vllm",
               "--engine-args", "--dtype float32 --max-model-len 1024", "--quiet"])
    wall = time.perf_counter() - t0
    assert rc == 0
    aux, final, tokens, absolute = _max_differences(setup["ours"], out)
    line = (f"engine capture of the default target: {tokens} tokens; max |engine - ours| / max |ours| per aux id "
            + ", ".join(f"{j}: {r:.1e} (abs {d:.1e})" for j, r, d in zip(AUX, aux, absolute))
            + f"; final normed state {final:.1e} (abs {absolute[-1]:.1e}); engine {tokens / wall:.0f} tok/s with the "
            f"server's start, ours {setup['ours_tps']:.0f} tok/s")
    print(line)
    kept = Path(os.environ.get("OUTRIDER_ENGINE_OUT", tmp_path))  # a folder made here when this test runs first
    kept.mkdir(parents=True, exist_ok=True)
    (kept / "engine-capture.txt").write_text(line + "\n")
    assert max(aux) < 1e-5 and final < 1e-5, line
    assert not list(Path(out).glob("*.safetensors.lock"))
    cfg = TrainConfig(steps=4, batch_size=2, grad_accum=1, max_length=48, lr=3e-3, warmup_steps=1, ttt_steps=3,
                      draft_vocab_size=40, eval_every=4, save_every=4, eval_examples=4, log_every=1)
    cfg.save(tmp_path / "cfg.json")
    losses = {}
    for name, cache in (("ours", setup["ours"]), ("engine", out)):
        run = tmp_path / name
        assert main(["train", str(setup["target"]), "--cache", str(cache), "--out", str(run), "--config",
                     str(tmp_path / "cfg.json"), "--quiet", "--device", "cpu"]) == 0
        losses[name] = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                        if r["type"] == "train"]
    assert len(losses["ours"]) == 4 and losses["engine"] == pytest.approx(losses["ours"], rel=1e-4)


class _DiesAfter(EngineSource):
    """The real source, whose server is stopped after ``calls`` of its batches."""

    def __init__(self, *args, calls: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = calls

    def states(self, input_ids):
        if self.calls == 0:
            self.process.stop()
        self.calls -= 1
        return super().states(input_ids)


def test_server_gone_mid_run_is_one_line_and_the_rerun_resumes(vllm, setup, monkeypatch, tmp_path):
    from outrider.interop.server_process import ServerProcess

    storage = tmp_path / "hs"
    storage.mkdir()
    env = engine_env.environ(vllm)
    env["PYTHONPATH"] = outrider_root()
    argv = [str(vllm / "bin" / "vllm"), "serve", str(setup["target"]), "--host", "127.0.0.1", "--port", "{port}",
            *extraction_args(str(setup["target"]), AUX, permuted.LAYERS, storage, cpu=True),
            "--enforce-eager", "--dtype", "float32", "--max-model-len", "512"]
    out = tmp_path / "cache"
    source = _DiesAfter(str(setup["target"]), AUX, None, storage, permuted.LAYERS, 128,
                        process=ServerProcess(argv, env=env, log=storage / "vllm.log"), timeout=20, calls=2,
                        pass_tokens=200, retries=2)
    with pytest.raises(UserError) as e:  # capture_cache enters the source: it starts the server, then loses it
        capture_cache(str(setup["target"]), str(setup["data"]), str(out), dtype="float32", aux_layer_ids=AUX,
                      max_tokens_per_shard=400, progress=False, source=source)
    assert "failed 2 times" in str(e.value) and "rerun" in str(e.value)
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and manifest["shards"]  # what was captured is kept
    with ServerProcess(argv, env=env, log=storage / "vllm2.log") as server:
        server.wait_ready(timeout=400)
        monkeypatch.setenv("PATH", env["PATH"])
        rc = main(["capture", str(setup["target"]), "--data", str(setup["data"]), "--out", str(out), "--dtype",
                   "float32", "--aux-layers", ",".join(map(str, AUX)), "--max-tokens-per-shard", "400", "--engine",
                   "vllm", "--server", server.url, "--engine-storage", str(storage), "--quiet"])
    assert rc == 0
    aux, final, _, _ = _max_differences(setup["ours"], out)
    assert max(aux) < 1e-5 and final < 1e-5
    assert not [p for p in storage.iterdir() if p.suffix in (".safetensors", ".lock")]  # no engine files left
