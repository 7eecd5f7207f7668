"""Logits to probabilities, and seeded per-request randomness.

Contract:
- ``SamplingParams`` fixes temperature, top-k and top-p; temperature 0 means greedy.
- ``probs(logits, params)`` applies temperature, then top-k, then top-p (nucleus) and returns
  float32 probabilities. Target and draft go through the same function, so speculative
  sampling is lossless with respect to this *processed* target distribution.
- ``RowRandom`` holds one ``torch.Generator`` per request (row), seeded ``seed + row``: a
  request's draws do not depend on what else is in the batch, and a fixed seed reproduces a run.
- ``sample(probs, u)`` draws by inverse CDF from explicit uniforms, so every random decision is
  made from a uniform drawn by ``RowRandom`` (easy to test, no hidden global RNG).

Not done here: repetition penalties, logit bias, min-p; stream seeds (``ops.seeds``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outrider.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., vocab] -> probabilities [..., vocab] (float32)."""
    x = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
    x = x / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(p, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        p = p.masked_fill(drop, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. p: [..., vocab] (need not be normalised), u: [...] in [0, 1)."""
    cdf = p.cumsum(-1)  # [..., vocab]
    target = u.to(cdf.dtype) * cdf[..., -1]
    idx = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)
    idx = idx.clamp_max(p.shape[-1] - 1)
    # never return a zero-probability token (possible only through rounding at the edges); no host
    # value is read, so a round's draws stay queued on the device
    bad = p.gather(-1, idx.unsqueeze(-1)).squeeze(-1) <= 0
    return torch.where(bad, p.argmax(-1), idx)


class RowRandom:
    """One generator per request; ``uniform(n)`` gives ``[rows, n]`` uniforms on the CPU's RNG."""

    def __init__(self, rows: int, seed: int, stream: int = 0):
        self.generators = []
        for r in range(rows):
            g = torch.Generator()
            g.manual_seed((seed + r) * 1000003 + stream)
            self.generators.append(g)

    def uniform(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        rows = [torch.rand(n, generator=g, dtype=torch.float64) for g in self.generators]
        return torch.stack(rows).to(device)  # [rows, n]

