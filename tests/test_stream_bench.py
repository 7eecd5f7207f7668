"""benchmarks/stream_bench.py at a tiny size on the CPU: its checkpoint is what compressed-tensors ships, and
the run writes its figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "stream_bench.py"


def run_bench(*args: str, rc: int = 0) -> subprocess.CompletedProcess:
    """The script as a user runs it."""
    run = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=900)
    assert run.returncode == rc, run.stderr[-3000:]
    return run


def test_checkpoint_is_pack_quantized_as_the_library_reads_it(tmp_path, tiny_dir):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from outrider.train.states.int4 import dequant_int4
    from outrider.train.states.weights import SafetensorsFiles

    folder = tmp_path / "ckpt"
    run_bench("--out", str(folder), "--shape", "tiny", "--device", "cpu", "--layers", "2", "--tokens-per-pass", "64",
              "--lo", "16", "--hi", "32", "--passes", "1", "--default-model", "none", "--keep",
              "--json", str(tmp_path / "r.json"))
    ckpt = json.loads((tmp_path / "r.json").read_text())["checkpoint"]
    files = SafetensorsFiles(folder)  # every header checked
    assert math.isclose(sum(p.stat().st_size for p in folder.glob("*.safetensors")), ckpt["bytes_gb"] * 1e9)
    c = json.loads((folder / "config.json").read_text())["text_config"]
    assert len(files.paths) == 3 + 2 and "language_model.lm_head.weight" in files
    p = "language_model.model.layers.2.mlp.experts.5.down_proj."
    sd = {k: files.tensor(p + k) for k in ("weight_packed", "weight_scale", "weight_shape")}
    assert sd["weight_shape"].tolist() == [c["hidden_size"], c["moe_intermediate_size"]]
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    library = BaseCompressor.get_value_from_registry("pack-quantized").decompress(
        sd, QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    ours = dequant_int4(sd["weight_packed"], sd["weight_scale"], c["moe_intermediate_size"])
    assert torch.equal(ours, library) and ours.std() > 0
    assert ckpt["moe_layer_dequantized_gb"] > ckpt["moe_layer_gb"] > 0


def test_tiny_run_reports_its_figures(tmp_path, tiny_dir):
    out = tmp_path / "ckpt"
    proc = run_bench("--out", str(out), "--shape", "tiny", "--device", "cpu", "--layers", "2",
                     "--tokens-per-pass", "300", "--lo", "16", "--hi", "48", "--passes", "1",
                     "--default-model", str(tiny_dir("llama")), "--default-tokens", "300",
                     "--json", str(tmp_path / "r.json"))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["layers"] == 3 and saved["stream"]["runs"][0]["tokens"] == 300
    run = saved["stream"]["runs"][0]
    assert run["nbytes"] > 0 and run["compute_s"] > 0 and 0 < run["efficiency"] <= 1.0 + 1e-9
    assert run["planned_peak_gb"] > 0 and "mlp" in saved["stream"]["working_set"]
    assert saved["kimi_prediction"]["262144"]["cached"]["hours_per_100M_ideal"] > 0
    assert saved["disk_read_gbps"] is None or saved["disk_read_gbps"] > 0
    assert saved["default_model"]["bit_identical"]  # float32 on the CPU: the same chunks, the same bits
    assert math.isclose(saved["default_model"]["tokens"], 300, abs_tol=0)
    assert not out.exists()  # removed without --keep
    assert "checkpoint:" in proc.stdout


def test_budget_refused_in_one_line(tmp_path):
    """A --gpu-memory below a layer and a one-token chunk: one line naming the figures, exit 2, no traceback."""
    proc = run_bench("--out", str(tmp_path / "ckpt"), "--shape", "tiny", "--device", "cpu", "--layers", "1",
                     "--tokens-per-pass", "64", "--lo", "16", "--hi", "32", "--passes", "1", "--default-model", "none",
                     "--gpu-memory", "0.0001", "--json", str(tmp_path / "r.json"), rc=2)
    err = [line for line in proc.stderr.splitlines() if "Warning" not in line and line.strip()]
    assert err[-1].startswith("stream_bench: error: --gpu-memory 0.0001 GB is too small for layer streaming")
    assert "Traceback" not in proc.stderr and not (tmp_path / "r.json").exists()
