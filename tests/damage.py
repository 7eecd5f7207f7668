"""Damaged copies of outrider's outputs, for fault tests (``tests/test_faults_answers.py``,
``benchmarks/faults.py``): values a checksum cannot catch. Each function copies ``src`` to ``dst``
and damages the copy; the original is never touched."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path


def head_with(src: Path, dst: Path, how: str) -> Path:
    """A head folder whose fc weight holds a NaN (``how="nan"``) or whose d2t maps a draft id past
    the target vocabulary (``how="d2t"``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    if how == "nan":
        name = next(k for k in sorted(tensors) if k.endswith("fc.weight"))
        tensors[name][0, 0] = float("nan")
    else:
        tensors["d2t"][0] = 10 ** 6
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def dataset_with_id(src: Path, dst: Path, token_id: int = 10 ** 6) -> Path:
    """A token dataset whose first train shard holds ``token_id`` in its first example; returns the shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(src, dst)
    shard = sorted(dst.glob("train-*.parquet"))[0]
    table = pq.read_table(shard)
    rows = table.column("input_ids").to_pylist()
    rows[0][3] = token_id
    column = pa.array(rows, type=table.schema.field("input_ids").type)
    pq.write_table(table.set_column(table.schema.get_field_index("input_ids"), "input_ids", column), shard)
    return shard


def cache_with_inf(src: Path, dst: Path) -> Path:
    """A hidden-state cache whose first shard holds an Inf aux state, its manifest checksum updated so
    that the shard passes it; returns the shard."""
    from safetensors import safe_open
    from safetensors.torch import save

    shutil.copytree(src, dst)
    shard = sorted(dst.glob("shard-*"))[0]
    with safe_open(str(shard), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["aux"][0, 0] = float("inf")
    blob = save(tensors, metadata=meta)
    shard.write_bytes(blob)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["shards"][0]["sha256"] = hashlib.sha256(blob).hexdigest()
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return shard
