"""One decode step of the default model on the CPU: our slot cache against transformers' dynamic cache.

    python benchmarks/cpu_step_probe.py      # median ms of 40 steps over a 300-token context, twice

Both decoders first prefill the same 300 random token ids, then time single-token steps; the
medians are printed side by side, alternating, so a drifting machine affects both alike.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from outrider.decode.runner import CachedLM
from outrider.models import load_model

CONTEXT, STEPS = 300, 40


def ours_ms(model, context: torch.Tensor) -> float:
    lm = CachedLM(model, 1, 1024)
    lm.forward(context, logits_at=torch.tensor([CONTEXT - 1]))
    lm.commit(torch.ones(1, CONTEXT, dtype=torch.bool))
    ids, keep = torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.bool)
    times = []
    for _ in range(STEPS):
        t = time.perf_counter()
        lm.forward(ids)
        lm.commit(keep, used=1)
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[STEPS // 2]


@torch.no_grad()
def transformers_ms(model, context: torch.Tensor) -> float:
    cache = DynamicCache()
    model(input_ids=context, past_key_values=cache, use_cache=True)
    ids = torch.tensor([[5]])
    times = []
    for i in range(STEPS):
        mask = torch.ones(1, CONTEXT + 1 + i, dtype=torch.long)
        t = time.perf_counter()
        model(input_ids=ids, past_key_values=cache, use_cache=True, attention_mask=mask)
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[STEPS // 2]


def main() -> None:
    model, _ = load_model("default")
    torch.manual_seed(0)
    context = torch.randint(100, 20000, (1, CONTEXT))
    for _ in range(2):
        print(f"ours {ours_ms(model, context):.2f} ms   transformers {transformers_ms(model, context):.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()
