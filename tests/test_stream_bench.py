"""benchmarks/stream_bench.py at a tiny size on the CPU: its checkpoint is what compressed-tensors ships, and
the run writes its figures."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "stream_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("stream_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checkpoint_is_pack_quantized_as_the_library_reads_it(bench, tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from outrider.train.int4 import dequant_int4
    from outrider.train.weights import SafetensorsFiles

    folder = tmp_path / "ckpt"
    info = bench.write_checkpoint(folder, "tiny", 3, torch.device("cpu"))
    files = SafetensorsFiles(folder)  # every header checked
    assert sum(p.stat().st_size for p in folder.glob("*.safetensors")) == info["bytes"]
    c = info["config"]["text_config"]
    assert len(files.paths) == 3 + 2 and "language_model.lm_head.weight" in files
    p = "language_model.model.layers.2.mlp.experts.5.down_proj."
    sd = {k: files.tensor(p + k) for k in ("weight_packed", "weight_scale", "weight_shape")}
    assert sd["weight_shape"].tolist() == [c["hidden_size"], c["moe_intermediate_size"]]
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    library = BaseCompressor.get_value_from_registry("pack-quantized").decompress(
        sd, QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    ours = dequant_int4(sd["weight_packed"], sd["weight_scale"], c["moe_intermediate_size"])
    assert torch.equal(ours, library) and ours.std() > 0
    assert bench.dequantized_layer_bytes(c, 1) > bench.layer_bytes(c, 1) > bench.layer_bytes(c, 0) // 4


def test_tiny_run_reports_its_figures(bench, tmp_path, tiny_dir):
    out = tmp_path / "ckpt"
    record = bench.main(["--out", str(out), "--shape", "tiny", "--device", "cpu", "--layers", "2",
                         "--tokens-per-pass", "300", "--lo", "16", "--hi", "48", "--passes", "1",
                         "--default-model", str(tiny_dir("llama")), "--default-tokens", "300",
                         "--json", str(tmp_path / "r.json")])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["layers"] == 3 and saved["stream"]["runs"][0]["tokens"] == 300
    run = saved["stream"]["runs"][0]
    assert run["nbytes"] > 0 and run["compute_s"] > 0 and 0 < run["efficiency"] <= 1.0 + 1e-9
    assert saved["kimi_prediction"]["262144"]["cached"]["hours_per_100M_ideal"] > 0
    assert saved["disk_read_gbps"] is None or saved["disk_read_gbps"] > 0
    assert saved["default_model"]["bit_identical"]  # float32 on the CPU: the same chunks, the same bits
    assert math.isclose(saved["default_model"]["tokens"], 300, abs_tol=0)
    assert not out.exists()  # removed without --keep
    assert record["commit"] == saved["commit"]
