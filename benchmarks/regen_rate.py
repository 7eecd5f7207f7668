"""How fast the demo's data stage regenerates replies, by batch size.

    python benchmarks/regen_rate.py [--batches 128,256,512] [--prompts 1024] [--max-new 256] [--out F]

The prompts are the first ``--prompts`` single exchanges of the full demo preset
(``sharegpt.training_exchanges``: later user turns, each alone), rendered with the default model's
chat template as regeneration renders them; each batch size regenerates all of them greedily through
the engine ``demo.engine_generate_fn`` builds (CUDA graphs on a GPU), in its waves of similar
length, after one untimed wave. Prints, per batch size, exchanges and new tokens per second, where a wave's time goes
(prefill against decode steps, ms per decode step) and how many of its row-steps made a token (a
wave steps until its longest reply ends: rows that stopped early idle); a final JSON line (``--out``
also writes it). ``--profile F``: one more wave at the last batch size under ``torch.profiler``, its
operators by device time written to F. Exit status 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from outrider import assets, sharegpt
from outrider.cliargs import POSITIVE, int_list
from outrider.decode.engine import SpecEngine, eos_token_ids
from outrider.demo import SIZES, engine_generate_fn
from outrider.errors import UserError
from outrider.fsutil import atomic_write_json
from outrider.models import load_model
from outrider.train.data.template import encode, render


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int_list(1, what="batch sizes"), default=[128, 256, 512])
    ap.add_argument("--prompts", type=POSITIVE, default=1024)
    ap.add_argument("--max-new", type=POSITIVE, default=256)
    ap.add_argument("--out")
    ap.add_argument("--profile", metavar="F", help="profile one wave at the last batch size into this text file")
    a = ap.parse_args(argv)
    try:
        size = SIZES["full"]
        assets.pull(progress=False)
        model, tok = load_model("default")
        cuda = torch.cuda.is_available()
        corpus = sharegpt.load_sharegpt(assets.sharegpt_path(pulled=True))
        singles = sharegpt.training_exchanges(corpus, 0, 0, a.prompts)
        prompts = []
        for ex in singles:
            msgs = [{"role": "user", "content": ex["conversations"][0]["value"]}]
            ids = encode(tok, render(tok, msgs, True))
            if len(ids) < size.max_length:
                prompts.append(ids)
        rows = []
        for b in a.batches:
            fn = engine_generate_fn(model, eos_token_ids(model, tok), batch_size=b, graphs=cuda)
            fn(sorted(prompts, key=len)[:b], a.max_new)  # warm-up: graphs captured, kernels chosen
            waves = timed_waves(fn.engine, prompts, b, a.max_new)
            s, new = waves.pop("seconds"), waves.pop("new_tokens")
            rows.append({"batch": b, "exchanges": len(prompts), "seconds": round(s, 2),
                         "exchanges_per_s": round(len(prompts) / s, 1), "new_tokens_per_s": round(new / s),
                         "mean_new_tokens": round(new / len(prompts), 1), **waves})
            print(f"batch {b}: {len(prompts)} exchanges in {s:.1f} s, {len(prompts) / s:.1f}/s, "
                  f"{new / s:,.0f} new tokens/s; prefill {waves['prefill_share']:.0%} of the waves' time, "
                  f"{waves['ms_per_step']:.2f} ms a decode step, {waves['busy_row_steps']:.0%} of row-steps "
                  "made a token", flush=True)
        if a.profile:
            profile_wave(fn.engine, sorted(prompts, key=len)[-a.batches[-1]:], a.max_new, cuda, a.profile)
        result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "max_new": a.max_new, "rows": rows}
        if a.out:
            atomic_write_json(a.out, result)
        print(json.dumps(result))
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def timed_waves(engine: SpecEngine, prompts: list[list[int]], batch: int, max_new: int) -> dict:
    """Every prompt regenerated through the regeneration's own (warm) engine in its waves (similar
    lengths, one engine call each): the wall seconds and new tokens, and, by the engine's marks,
    prefill and decode seconds, decode steps (a wave steps until its longest reply ends), and the
    share of row-steps that made a token."""
    order = sorted(prompts, key=len)
    prefill = decode = 0.0
    steps = row_steps = made = new = 0
    engine.sync()
    t = time.perf_counter()
    for i in range(0, len(order), batch):
        wave = order[i:i + batch]
        r = engine.generate(wave, max_new)
        prefill += r.prefill_s
        decode += r.decode_s
        longest = max(len(t) for t in r.tokens) - 1  # decode steps: the first token comes from the prefill
        steps += longest
        row_steps += longest * len(wave)
        made += sum(len(t) - 1 for t in r.tokens)
        new += sum(len(t) for t in r.tokens)
    engine.sync()
    return {"seconds": time.perf_counter() - t, "new_tokens": new, "prefill_s": round(prefill, 2),
            "decode_s": round(decode, 2), "decode_steps": steps,
            "prefill_share": prefill / max(prefill + decode, 1e-9), "ms_per_step": 1000 * decode / max(steps, 1),
            "busy_row_steps": made / max(row_steps, 1)}


def profile_wave(engine: SpecEngine, wave: list[list[int]], max_new: int, cuda: bool, path: str) -> None:
    """One wave through the warm engine under ``torch.profiler``: its operators by device time into ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        engine.generate(wave, max_new)
        if cuda:
            torch.cuda.synchronize()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=90))
    print(f"profile of one wave of {len(wave)}: {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
