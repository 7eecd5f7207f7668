"""A separate (smaller) causal LM that drafts k tokens autoregressively.

Contract: the draft model shares the target's tokenizer and vocabulary (checked by the caller,
``interop.drafts.check_pair``). It keeps its own ``CachedLM``; tokens the target has committed but the
draft has not yet seen are *pending* per row (1 after a rejection, 2 when all k drafts were
accepted: the last draft and the bonus token). Each ``propose`` first feeds the pending tokens
(ragged, right-aligned, padding masked), then k-1 single-token steps. Guesses the target
rejected are rolled back from the draft's cache, never recomputed from scratch.
Greedy drafting when the sampling temperature is 0; otherwise tokens are sampled from the
processed draft distribution ``q``, which is returned for verification.
"""

from __future__ import annotations

import torch

from outrider.decode.draft import Draft
from outrider.decode.proposers.base import Outcome, Proposer, StartContext
from outrider.decode.runner import CachedLM
from outrider.decode.sampling import RowRandom, probs, sample


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @classmethod
    def build(cls, target: torch.nn.Module, draft: torch.nn.Module = None, **options: object) -> "DraftModelProposer":
        return cls(draft)

    def start(self, ctx: StartContext) -> None:
        super().start(ctx)
        B = len(ctx.histories)
        P = int(ctx.prompt_lens.max())
        self.lm = CachedLM(self.model, B, ctx.max_len)
        self.rand = RowRandom(B, ctx.sampling.seed, stream=1)
        dev = self.lm.device
        ids = torch.zeros(B, P, dtype=torch.long, device=dev)
        for b, h in enumerate(ctx.histories):
            n = int(ctx.prompt_lens[b])
            ids[b, :n] = torch.tensor(h[:n], device=dev)
        valid = torch.arange(P, device=dev)[None, :] < ctx.prompt_lens.to(dev)[:, None]
        self.lm.forward(ids, query_valid=valid, logits_at=torch.tensor([P - 1], device=dev))
        self.lm.commit(valid)
        self.pending = [[int(t)] for t in ctx.last.tolist()]
        self.k_last = 0

    def _draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # logits: [batch, vocab] -> token [batch], q [batch, vocab] (None when greedy)
        if self.ctx.sampling.greedy:
            return logits.argmax(-1), None
        q = probs(logits, self.ctx.sampling)
        return sample(q, self.rand.uniform(1, q.device)[:, 0]), q

    def propose(self, k: int) -> Draft:
        B = len(self.pending)
        dev = self.lm.device
        n = max(len(p) for p in self.pending)
        ids = torch.zeros(B, n, dtype=torch.long, device=dev)
        valid = torch.zeros(B, n, dtype=torch.bool, device=dev)
        for b, pend in enumerate(self.pending):
            ids[b, n - len(pend):] = torch.tensor(pend, device=dev)
            valid[b, n - len(pend):] = True
        # right-aligned: positions count back from the last (real) token
        offsets = valid.long().cumsum(1) - 1  # [batch, n]
        positions = self.lm.lengths[:, None] + offsets
        logits = self.lm.forward(ids, positions=positions, query_valid=valid)[:, -1]
        self.lm.commit(valid)
        tokens, qs = [], []
        for i in range(k):
            tok, q = self._draw(logits)
            tokens.append(tok)
            qs.append(q)
            if i + 1 < k:
                logits = self.lm.forward(tok[:, None])[:, -1]
                self.lm.commit(torch.ones(B, 1, dtype=torch.bool, device=dev))
        self.k_last = k
        q_all = None if qs[0] is None else torch.stack(qs, dim=1)  # [batch, k, vocab]
        return Draft.chain(torch.stack(tokens, dim=1), torch.full((B,), k, device=dev), q_all)

    def observe(self, outcome: Outcome) -> None:
        k = self.k_last
        a = outcome.num_accepted.to(self.lm.device)  # [batch]
        # the cache holds d_1..d_{k-1}; keep d_1..d_min(a, k-1), drop the rest
        self.lm.rollback((k - 1) - a.clamp_max(k - 1))
        tok = outcome.tokens
        self.pending = []
        for b in range(tok.shape[0]):
            ab = int(a[b])
            self.pending.append([int(tok[b, k - 1]), int(tok[b, k])] if ab == k else [int(tok[b, ab])])

    def close(self) -> None:
        self.lm.close()
