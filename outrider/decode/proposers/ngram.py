"""n-gram prompt lookup: propose the continuation of the most recent earlier occurrence of the
longest matching suffix.

Contract: for each row, try suffix lengths n = max_n .. min_n of the row's history (prompt +
emitted tokens); the first n whose suffix occurs earlier in the history wins, and the (up to k)
tokens that followed its most recent earlier occurrence are proposed. Overlapping occurrences
count (a self-repeating run proposes its own continuation). No match proposes nothing for that
row (``num = 0``), and the engine then spends no draft slots on it. No model, no probabilities.
"""

from __future__ import annotations

import torch

from outrider.decode.draft import Draft
from outrider.decode.proposers.base import Proposer
from outrider.errors import require


def ngram_lookup(history: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to k tokens following the most recent earlier match of the longest suffix."""
    L = len(history)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = history[L - n:]
        # search right to left for an earlier occurrence that starts before L - n
        for start in range(L - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                cont = history[start + n:start + n + k]
                if cont:
                    return cont
    return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        require(1 <= min_n <= max_n, f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n

    @classmethod
    def build(cls, target: torch.nn.Module, draft: object = None, ngram_min: int = 1, ngram_max: int = 4,
              **options: object) -> "NgramProposer":
        return cls(ngram_min, ngram_max)

    def propose(self, k: int) -> Draft:
        rows = [ngram_lookup(h, k, self.min_n, self.max_n) for h in self.ctx.histories]
        B = len(rows)
        tokens = torch.zeros(B, k, dtype=torch.long)
        num = torch.zeros(B, dtype=torch.long)
        for b, cont in enumerate(rows):
            tokens[b, :len(cont)] = torch.tensor(cont, dtype=torch.long)
            num[b] = len(cont)
        return Draft.chain(tokens.to(self.ctx.device), num.to(self.ctx.device), None)
