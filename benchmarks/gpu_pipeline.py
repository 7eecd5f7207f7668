"""GPU pipeline on the default model: regenerate training responses with the target (our engine,
CUDA graphs), train an EAGLE-3 head, export it for vLLM. One device call; figures go to --out.

    python benchmarks/gpu_pipeline.py --dataset F --out DIR --config train.json [--conversations N]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from outrider.decode.engine import eos_token_ids
from outrider.demo import engine_generate_fn
from outrider.fsutil import atomic_write_json
from outrider.heads.formats import export
from outrider.models import load_model
from outrider.train.prepare import build_dataset
from outrider.train.trainer import train


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--regen-tokens", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--figures", required=True)
    a = ap.parse_args()
    figures = {"device": torch.cuda.get_device_name(0)}
    model, tok = load_model("default", device="cuda", dtype="bfloat16")
    eos = eos_token_ids(model, tok)
    t = time.perf_counter()
    report = build_dataset("default", a.dataset, f"{a.out}/data", max_conversations=a.conversations,
                           max_length=a.max_length, regenerate=True, max_new_tokens=a.regen_tokens,
                           generate_fn=engine_generate_fn(model, eos, batch_size=64, graphs=True), progress=False)
    figures["data_s"] = time.perf_counter() - t
    figures["data"] = report.to_dict()
    print("data", f"{figures['data_s']:.0f} s", report.summary(), flush=True)
    atomic_write_json(a.figures, figures)
    t = time.perf_counter()
    rep = train("default", f"{a.out}/data", f"{a.out}/train", config=a.config, progress=False,
                loaded_target=(model, tok))
    figures["train_wall_s"] = time.perf_counter() - t
    figures["train"] = rep.to_dict()
    print("train", rep.summary() if hasattr(rep, "summary") else rep, flush=True)
    atomic_write_json(a.figures, figures)
    ex = export(f"{a.out}/train/head", "vllm", f"{a.out}/export-vllm", target="default")
    print(ex.summary(), flush=True)
    figures["export"] = ex.to_dict()
    atomic_write_json(a.figures, figures)
    print(json.dumps({k: v for k, v in figures.items() if k != "data"}, default=str)[:4000])


if __name__ == "__main__":
    main()
