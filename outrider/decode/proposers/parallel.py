"""Parallel drafting (P-EAGLE, arXiv 2602.01469): all k draft tokens from ONE head forward.

Contract: a parallel-drafting head (``Eagle3Config.parallel_drafting``, with ``mask_hidden``)
receives, in one forward, the pending block of committed pairs (as EAGLE-3's pending step:
aux_t with x_{t+1}, right-aligned, padding masked) followed by k - 1 placeholder positions
(token ``mask_token_id``, hidden fc(mask_hidden)) at positions P+1 .. P+k-1 after the last
committed pair's position P. This is the input vLLM builds for ``parallel_drafting: true``
(``llm_base_proposer.py``: bonus slot, then K - 1 masked slots at consecutive positions). The
attention is causal by position over the head cache: the placeholders' keys and values are
written at their positions past the committed ones, like the chain's speculative entries, and the
next round's real pairs overwrite them. The outputs at the last real position and the k - 1
placeholders give d_1 .. d_k: greedy through ``d2t``, or each sampled from its own softmax with
``q`` returned (independent draws; the engine's verification keeps decoding lossless).

On CUDA with ``graphs=True`` and greedy drafting, ``propose`` replays the forward and its draws
as one CUDA graph per (batch, width, k), as the EAGLE-3 chain does (``Eagle3Proposer._replay``: the
same cache pool, prompt padding and keys); in device rounds the engine captures ``propose_device``
within its own round graph. When the engine compiles its step, ``torch.compile`` fuses the greedy
forward with its draws (once per batch and k; a prompt's block, of any width, runs eagerly) and
the alignment of a round's accepted pairs (``Eagle3Proposer.observe``).

Not done here: trees.
"""

from __future__ import annotations

from typing import Callable

import torch

from outrider.decode.proposers.base import StartContext
from outrider.decode.proposers.eagle3 import Eagle3Proposer
from outrider.decode.proposers.head_cache import HeadCache, head_step
from outrider.decode.sampling import RowRandom, SamplingParams, probs, sample


class ParallelProposer(Eagle3Proposer):
    name = "parallel"

    def __init__(self, head: torch.nn.Module, target: torch.nn.Module):
        if getattr(head, "mask_hidden", None) is None or not head.config.parallel_drafting:
            raise ValueError("ParallelProposer needs a parallel-drafting head (one with mask_hidden)")
        super().__init__(head, target)

    def start(self, ctx: StartContext) -> None:
        super().start(ctx)
        self._block = self.fused(ctx.compile, self._block_greedy)[0]

    def _forward(self, cache: HeadCache, aux: torch.Tensor, nxt: torch.Tensor, valid: torch.Tensor, k: int
                 ) -> torch.Tensor:
        """The one forward: hidden_out [batch, k, H] at the last real position and k - 1 placeholders
        (their keys and values written past the committed ones; the caller commits the real pairs)."""
        # aux: [batch, n, n_aux * H_t]; nxt, valid: [batch, n]
        B = nxt.shape[0]
        head = self.head
        hidden = head.fuse(aux.to(head.fc.weight.dtype))  # [batch, n, H]
        tokens = nxt
        if k > 1:
            mask_ids, mask_h = head.placeholder(B, k - 1)  # [batch, k-1], [batch, k-1, H]
            hidden = torch.cat([hidden, mask_h.to(hidden.dtype)], dim=1)  # [batch, n+k-1, H]
            tokens = torch.cat([nxt, mask_ids], dim=1)
            valid = torch.cat([valid, valid.new_ones(B, k - 1)], dim=1)
        positions = cache.place(valid)  # [batch, n+k-1]: placeholders at P+1 .. P+k-1
        mask = cache.mask(positions[:, -k:], valid[:, -k:])  # [batch, 1, k, slots]
        return head_step(head, self.embedding, cache, tokens, hidden, positions, mask)  # [batch, k, H]

    def _block_greedy(self, cache: HeadCache, aux: torch.Tensor, nxt: torch.Tensor, valid: torch.Tensor, k: int
                      ) -> torch.Tensor:
        """The forward and its greedy drafts as target ids [batch, k] (one compiled function)."""
        return self.head.map_to_target(self.head.compute_logits(self._forward(cache, aux, nxt, valid, k)).argmax(-1))

    def _chain(self, aux: torch.Tensor, nxt: torch.Tensor, valid: torch.Tensor, k: int, prompt: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one forward over the pending block and k - 1 placeholders (eager for a prompt's block),
        then the k draws: (tokens [batch, k], q [batch, k, vocab] or None); what
        ``Eagle3Proposer.propose`` runs or replays."""
        if self.ctx.sampling.greedy:
            out = (self._block_greedy if prompt else self._block)(self.cache, aux, nxt, valid, k), None
        else:
            out = block_draws(self.head.compute_logits(self._forward(self.cache, aux, nxt, valid, k)),
                              self.head.map_to_target, self.ctx.sampling, self.rand, self.vocab)
        self.cache.lengths += valid.sum(1)  # only the real pairs are committed
        return out


def block_draws(logits: torch.Tensor, to_target: Callable[[torch.Tensor], torch.Tensor], sampling: SamplingParams,
                rand: RowRandom, vocab: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The k drafts of one forward from their draft logits [batch, k, draft_vocab]: target ids [batch,
    k] (argmax when greedy), and when sampling q [batch, k, vocab], each position drawn from its own
    softmax (independent draws; the verification keeps decoding lossless)."""
    if sampling.greedy:
        return to_target(logits.argmax(-1)), None
    B, k, Vd = logits.shape
    qd = probs(logits.reshape(B * k, Vd), sampling).reshape(B, k, Vd)
    d = sample(qd, rand.uniform(k, qd.device))  # [batch, k]
    q = qd.new_zeros(B, k, vocab)
    q[:, :, to_target(torch.arange(Vd, device=qd.device))] = qd
    return to_target(d), q
