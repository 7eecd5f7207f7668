"""The lossless verdict of a greedy run: exact, equal up to near-ties, or a mismatch.

Contract: ``judge(model, prompts, reference, runs, k)`` compares each run's outputs with plain
greedy decoding's (``reference``) token for token. Where a prompt's outputs part, at generated
token j, the target's logits for the two competing tokens (a from plain decoding, s from the
method) are taken in both paths as the engines compute them: the one-token step that plain
decoding runs (a cache over the context but its last token, then that token alone) and the
verification forward (the last ``k + 1`` context tokens in one forward over the cache of the rest).
The difference is a near-tie when |l(a) - l(s)| is within the bound in both paths; anything else
is a mismatch. The rest of a prompt after its first difference is not compared: the texts
continue from different tokens.

The bound is derived, not chosen: twice the largest difference of the same logit (over each
position's top ``TOP`` tokens) between two plain runs of the same text in different shapes (the
whole text in one forward, and its last ``STEPS`` tokens as one-token steps over the cache of the
rest), measured on the reference texts, in the run's dtype and device. In float32 it is tiny, and
a correct engine is ``exact``; a broken acceptance rule emits tokens the target never ranked
first, whose margins exceed any rounding.

Not done here: sampled runs (their outputs are random; the suite's distribution tests judge them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from outrider.models import cache_parameter

TOP = 8  # tokens per position whose logits bound the rounding (the ones an argmax decides between)
STEPS = 16  # one-token steps per text in the bound's second shape
BOUND_TEXTS = 8  # reference texts the bound is measured on


@dataclass
class Verdict:
    kind: str  # "exact", "near-ties" or "NO"
    near_ties: int = 0
    largest_margin: float | None = None  # the largest near-tie margin (logits)
    bound: float | None = None  # near-tie bound (logits), measured when any output differed
    first_mismatch: dict[str, Any] | None = None  # {"prompt", "token", "margin"}; margin None: lengths differ

    @property
    def lossless(self) -> bool:
        return self.kind != "NO"

    def text(self) -> str:
        if self.kind == "exact":
            return "exact"
        if self.kind == "near-ties":
            return (f"equal up to {self.near_ties} near-tie{'s' * (self.near_ties != 1)} "
                    f"(largest margin {self.largest_margin:.3g}, bound {self.bound:.3g})")
        m = self.first_mismatch or {}
        margin = "outputs differ in length" if m.get("margin") is None else f"margin {m['margin']:.3g}"
        return f"NO: prompt {m.get('prompt')}, token {m.get('token')}, {margin}"

    def short(self) -> str:
        """For a table cell."""
        return {"exact": "exact", "near-ties": f"ties {self.near_ties}"}.get(self.kind, "NO")

    def record(self) -> dict[str, Any]:
        return {"verdict": self.text(), "near_ties": self.near_ties, "largest_margin": self.largest_margin,
                "near_tie_bound": self.bound, "first_mismatch": self.first_mismatch, "lossless": self.lossless}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token lists differ (a shorter list differs at its end); None if equal."""
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _forward(model: torch.nn.Module, ids: list[int], cache: DynamicCache) -> torch.Tensor:
    """Logits [n, vocab] (float32) of ``ids`` after what ``cache`` holds; the cache grows in place."""
    x = torch.tensor([ids], device=_device(model))  # [1, n]
    return model(input_ids=x, use_cache=True, **{cache_parameter(model.forward): cache}).logits[0].float()


def _fill(model: torch.nn.Module, ids: list[int], cache: DynamicCache) -> None:
    """Run ``ids`` into ``cache`` only: the logits of the last position alone, not a [n, vocab]
    projection that would be thrown away (large at the vocabularies of the targets outrider is for)."""
    x = torch.tensor([ids], device=_device(model))  # [1, n]
    model(input_ids=x, use_cache=True, logits_to_keep=1, **{cache_parameter(model.forward): cache})


@torch.no_grad()
def _last_logits(model: torch.nn.Module, ids: list[int], tail: int) -> torch.Tensor:
    """Logits [tail, vocab] (float32) of the last ``tail`` positions of ``ids``, computed as the
    engines compute a step of that width: one forward over the cache of ``ids[:-tail]``, then the
    last ``tail`` tokens in one forward."""
    cache = DynamicCache(config=model.config)
    _fill(model, ids[:-tail], cache)
    return _forward(model, ids[-tail:], cache)


@torch.no_grad()
def noise_bound(model: torch.nn.Module, texts: Sequence[Sequence[int]]) -> float:
    """Twice the largest |difference| of a top-``TOP`` logit between the whole-text forward and
    one-token steps over the same positions (see the module docstring)."""
    worst = 0.0
    for ids in list(texts)[:BOUND_TEXTS]:
        ids = list(ids)
        n = min(STEPS, len(ids) - 1)
        if n < 1:
            continue
        whole = _forward(model, ids, DynamicCache(config=model.config))[-n:]  # [n, vocab]
        cache = DynamicCache(config=model.config)
        _fill(model, ids[:-n], cache)
        stepped = torch.cat([_forward(model, [t], cache) for t in ids[-n:]])  # [n, vocab]
        top = whole.topk(min(TOP, whole.shape[-1]), dim=-1).indices  # [n, TOP]
        worst = max(worst, float((whole.gather(-1, top) - stepped.gather(-1, top)).abs().max()))
    return 2.0 * worst


def tie_margins(model: torch.nn.Module, context: Sequence[int], a: int, s: int, k: int) -> tuple[float, float]:
    """l(a) - l(s) after ``context``, in the one-token step and in a (k+1)-token verification."""
    ids = list(context)
    step = _last_logits(model, ids, 1)[-1]
    verify = _last_logits(model, ids, max(1, min(k + 1, len(ids) - 1)))[-1]
    return float(step[a] - step[s]), float(verify[a] - verify[s])


def judge(model: torch.nn.Module, prompts: Sequence[Sequence[int]], reference: Sequence[Sequence[int]],
          runs: Sequence[Sequence[Sequence[int]]], k: int) -> Verdict:
    """The verdict of greedy ``runs`` (each a list of outputs per prompt) against ``reference``."""
    diffs: dict[tuple[int, int], tuple[int | None, int | None]] = {}  # (prompt, token) -> (a, s)
    for outputs in runs:
        for i, (ref, out) in enumerate(zip(reference, outputs)):
            j = first_difference(ref, out)
            if j is not None and (i, j) not in diffs:
                diffs[(i, j)] = (ref[j] if j < len(ref) else None, out[j] if j < len(out) else None)
    if not diffs:
        return Verdict("exact")
    bound = noise_bound(model, [list(p) + list(r) for p, r in zip(prompts, reference)])
    ties, largest = 0, 0.0
    for (i, j), (a, s) in sorted(diffs.items()):
        if a is None or s is None:  # one output stopped where the other went on, with no token parting them
            return Verdict("NO", ties, largest if ties else None, bound, {"prompt": i, "token": j, "margin": None})
        margin = max(abs(m) for m in tie_margins(model, list(prompts[i]) + list(reference[i][:j]), a, s, k))
        if margin > bound:
            return Verdict("NO", ties, largest if ties else None, bound, {"prompt": i, "token": j, "margin": margin})
        ties, largest = ties + 1, max(largest, margin)
    return Verdict("near-ties", ties, largest, bound)
