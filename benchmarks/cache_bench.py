"""Hidden-state cache benchmark on the default model: what fp8 costs in accuracy, capture speed and
size, and training from a cache against online training on the same data and budget.

One run, three parts (``--parts``, default all):
- ``quant``: on ``--quant-examples`` examples, the error of fp8 storage with one scale per token row and
  state against one per block of ``--blocks`` values: relative RMS error of the aux states, and of the
  teacher (KL from the bf16-free teacher, argmax agreement) over a 32k draft vocabulary of the data;
  the same for teachers stored as their ``--topk`` largest logits; bytes per token of each scheme;
- ``capture``: ``outrider capture`` of the data in bf16, fp8 and fp8 with the first ``--topk`` teacher:
  tokens/s, bytes/token, MB;
- ``train``: the same config (``--steps`` optimizer steps, no time budget) trained online and from
  each cache: tokens/s and MFU (from the trainer's report), the walked tau at ``tau_k`` of the final
  evaluation, losses.
Prints the figures and writes a JSON record (hardware, date, commit, command) to ``--json``.

On an H200 (about 5 minutes: three compilations of the head dominate): ``python benchmarks/cache_bench.py --data DATA --work /tmp/cb
--json benchmarks/results/cache/h200-cache_bench.json`` with DATA an ``outrider data default`` folder.
On a CPU, tiny: ``--examples 12 --steps 3 --max-length 96 --quant-examples 4``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from outrider.config import TrainConfig
from outrider.train.data.datasets import load_dataset, read_manifest, write_dataset
from outrider.train.loop.trainer import train
from outrider.train.options import TrainOptions
from outrider.train.states.cache import dequantize, quantize, teacher_rows, topk_teacher
from outrider.train.states.cache_capture import capture_cache


def _subset(data: str, out: Path, examples: int, eval_examples: int) -> str:
    """The first ``examples`` training and ``eval_examples`` eval examples of ``data``, as a dataset."""
    manifest = read_manifest(data)
    rows = {}
    for split, n in (("train", examples), ("eval", eval_examples)):
        ds = load_dataset(data, split)
        rows[split] = [(c, ids.tolist(), m.tolist()) for ids, m, c in
                       list(zip(ds.input_ids, ds.loss_mask, ds.conv_ids))[:n]]
    if out.exists():
        shutil.rmtree(out)
    write_dataset(out, {**manifest, "splits": {}}, rows, 8192)
    return str(out)


@torch.no_grad()
def quant_part(data: str, n: int, blocks: list[int], device: str, topks: list[int] = ()) -> dict:
    from outrider.models import load_model
    from outrider.train.data.vocab import build_draft_vocab
    from outrider.train.states.capture import ModelSource

    model, _ = load_model("default", device=device, dtype="bfloat16" if device == "cuda" else "float32",
                          with_tokenizer=False)
    ds = load_dataset(data, "train")
    H, V = model.config.hidden_size, model.config.vocab_size
    vocab = build_draft_vocab(zip(ds.input_ids, ds.loss_mask), V, 32000)
    w = model.get_output_embeddings().weight.index_select(0, vocab.draft_ids.to(device)).float()  # [Vd, H]
    L = model.config.num_hidden_layers
    src = ModelSource(model, (2, L // 2, L - 3), batch_tokens=4096)
    seqs = [x.astype(np.int64).tolist() for x in ds.input_ids[:n]]
    states = src.states(seqs)
    aux = torch.cat([a.float().reshape(-1, 3, H) for a, _ in states])  # [N, 3, H]
    finals = torch.cat([f.float()[torch.from_numpy(teacher_rows(m)).to(f.device)]
                        for (_, f), m in zip(states, ds.loss_mask[:n])])  # [M, H]
    out = {"tokens": int(aux.shape[0]), "teacher_rows": int(finals.shape[0]), "hidden": H, "schemes": {}}
    f = finals.shape[0] / aux.shape[0]
    for block in [H] + [b for b in blocks if b != H]:
        qa, sa = quantize(aux, block)
        qf, sf = quantize(finals, block)
        da, df = dequantize(qa, sa, torch.float32), dequantize(qf, sf, torch.float32)
        nb = H // block  # scales per state and token row
        out["schemes"][f"block{block}"] = {
            "aux_rel_rmse": float((da - aux).norm() / aux.norm()),
            "final_rel_rmse": float((df - finals).norm() / finals.norm()),
            **_teacher_error(finals, df, w),
            "bytes_per_token": 3 * H + 3 * 4 * nb + f * (H + 4 * nb) + 5,
        }
    out["bf16_final"] = {**_teacher_error(finals, finals.to(torch.bfloat16).float(), w),
                         "bytes_per_token": 6 * H + f * 2 * H + 5}
    full = model.get_output_embeddings().weight.float()  # [V, H]
    draft_index = torch.full((V,), -1, dtype=torch.long, device=full.device)
    draft_index[vocab.draft_ids.to(full.device)] = torch.arange(len(vocab.draft_ids), device=full.device)
    for k in topks:  # fp8 aux states, the teacher as its top-k logits (cache.encode, cache.topk_teacher)
        kl, agree = [], []
        for i in range(0, finals.shape[0], 512):
            logits = finals[i:i + 512] @ full.t()  # [rows, V]
            values, ids = logits.topk(k, -1)
            q = torch.log_softmax(topk_teacher(ids, values.to(torch.bfloat16), torch.logsumexp(logits, -1),
                                               draft_index, V, torch.float32), -1)
            p = torch.log_softmax(finals[i:i + 512] @ w.t(), -1)
            kl.append((p.exp() * (p - q)).sum(-1))
            agree.append(p.argmax(-1) == q.argmax(-1))
        kls = torch.cat(kl)
        out["schemes"][f"top{k}"] = {"teacher_kl_mean": float(kls.mean()), "teacher_kl_p99": float(kls.quantile(0.99)),
                                     "teacher_argmax_agree": float(torch.cat(agree).float().mean()),
                                     "bytes_per_token": 3 * H + 3 * 4 + f * (6 * k + 4) + 5}
    out["loss_row_fraction"] = f
    out["bf16_four_state_bytes"] = 8 * H
    return out


def _teacher_error(final: torch.Tensor, approx: torch.Tensor, w: torch.Tensor, rows: int = 512) -> dict:
    """KL(p || q) and argmax agreement of the teachers ``softmax(final w^T)`` and ``softmax(approx w^T)``
    over the draft vocabulary (``w`` [Vd, H]), a few rows at a time."""
    kl, agree = [], []
    for i in range(0, final.shape[0], rows):
        p = torch.log_softmax(final[i:i + rows] @ w.t(), -1)  # [rows, Vd]
        q = torch.log_softmax(approx[i:i + rows] @ w.t(), -1)
        kl.append((p.exp() * (p - q)).sum(-1))
        agree.append(p.argmax(-1) == q.argmax(-1))
    k = torch.cat(kl)
    return {"teacher_kl_mean": float(k.mean()), "teacher_kl_p99": float(k.quantile(0.99)),
            "teacher_argmax_agree": float(torch.cat(agree).float().mean())}


def capture_part(data: str, work: Path, device: str, topk: int = 0) -> dict:
    out = {}
    for name in ("bf16", "fp8") + ((f"fp8-top{topk}",) if topk else ()):
        dtype = name.split("-")[0]
        path = work / f"cache-{name}"
        if path.exists():
            shutil.rmtree(path)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        r = capture_cache("default", data, str(path), dtype=dtype, device=device, progress=False,
                          teacher_topk=topk if name.endswith(f"top{topk}") else 0)
        wall = time.perf_counter() - t
        four = 8 * json.loads((path / "header.json").read_text())["target"]["hidden_size"]  # bf16 x 4 states
        out[name] = {"tokens": r.tokens, "bytes": r.bytes, "bytes_per_token": round(r.bytes_per_token, 1),
                      "share_of_bf16_four_states": round(r.bytes_per_token / four, 4),
                      "tokens_per_s": round(r.tokens_per_s, 1), "wall_s": round(wall, 2), "shards": r.shards,
                      "path": str(path)}
    return out


def train_part(data: str, work: Path, cfg: TrainConfig, device: str, variants: list[str]) -> dict:
    out = {}
    for name in variants:
        run = work / f"train-{name}"
        if run.exists():
            shutil.rmtree(run)
        cache = None if name == "online" else str(work / f"cache-{name}")
        t = time.perf_counter()
        r = train(TrainOptions("default", data if cache is None else None, str(run), config=cfg, device=device,
                               progress=False, cache=cache))
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [x for x in rows if x["type"] == "train"]
        steady = steps[len(steps) // 4:] or steps
        out[name] = {
            "tokens_per_s": round(r.tokens_per_s, 1), "mfu": r.mfu, "train_s": round(r.train_s, 2),
            "wall_s": round(time.perf_counter() - t, 2), "steps": r.steps, "train_tokens": r.train_tokens,
            "median_step_tokens_per_s": float(np.median([x["tokens_per_s"] for x in steady])),
            "median_step_mfu": float(np.median([x["mfu"] for x in steady])) if "mfu" in steady[0] else None,
            "walk_tau_k": r.final_eval.get("walk_tau_k"), "sim_tau_k": r.final_eval.get("sim_tau_k"),
            "eval_loss": r.final_eval.get("loss"), "last_train_loss": steps[-1]["loss"], "notes": r.notes,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="an `outrider data default` folder")
    ap.add_argument("--work", default="/tmp/cache-bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--parts", default="quant,capture,train")
    ap.add_argument("--examples", type=int, default=6000, help="training examples taken from --data")
    ap.add_argument("--eval-examples", type=int, default=256)
    ap.add_argument("--quant-examples", type=int, default=64)
    ap.add_argument("--blocks", default="64,32", help="fp8 block sizes compared with one scale per row")
    ap.add_argument("--topk", default="16,32,64", help="top-k teachers measured (the first is also captured and "
                    "trained on: capture --teacher-topk)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps of each training run")
    ap.add_argument("--max-length", type=int, default=None, help="override the preset's max_length")
    ap.add_argument("--config", default=None, help="JSON of training settings over the device's preset")
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    data = _subset(a.data, work / "data", a.examples, a.eval_examples)
    cfg = TrainConfig.preset("full" if device == "cuda" else "quick")
    if a.config:
        cfg = TrainConfig.from_dict({**cfg.to_dict(), **json.loads(Path(a.config).read_text())})
    cfg = cfg.replace(steps=a.steps, time_budget_s=0.0, warmup_steps=min(cfg.warmup_steps, a.steps // 4),
                      eval_every=a.steps, save_every=a.steps)
    if a.max_length:
        cfg = cfg.replace(max_length=a.max_length)
    parts = a.parts.split(",")
    topks = [int(k) for k in a.topk.split(",") if k]
    record = {"benchmark": "cache_bench", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join([sys.executable] + sys.argv),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).parent).stdout.strip(),
              "hardware": {"device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                           "cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
              "config": cfg.to_dict(), "examples": a.examples}
    if "quant" in parts:
        record["quant"] = quant_part(data, a.quant_examples, [int(b) for b in a.blocks.split(",") if b], device,
                                     topks)
        print(json.dumps(record["quant"], indent=2))
    if "capture" in parts:
        record["capture"] = capture_part(data, work, device, topks[0] if topks else 0)
        print(json.dumps(record["capture"], indent=2))
    if "train" in parts:
        variants = ["online", "bf16", "fp8"] + ([f"fp8-top{topks[0]}"] if topks else [])
        record["train"] = train_part(data, work, cfg, device, variants)
        t = record["train"]
        record["cache_speedup_tokens_per_s"] = {k: round(t[k]["tokens_per_s"] / t["online"]["tokens_per_s"], 2)
                                                for k in variants[1:]}
        print(json.dumps(record["train"], indent=2))
        print("speedup of the cache path (tokens/s):", record["cache_speedup_tokens_per_s"])
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
