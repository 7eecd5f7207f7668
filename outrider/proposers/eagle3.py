"""EAGLE-3 drafting: a chain of k tokens from the head, fed with the target's own hidden states.

Contract: the head at position t reads the target's fused aux states at t and the token at t+1,
and predicts the token at t+2 (``outrider.head``). After every verification the target's aux
states of the committed positions, paired with the tokens that follow them, are *pending*; the
next ``propose`` feeds them to the head (ragged per row, right-aligned, padding masked), which
yields the first draft token; steps 2..k feed back the head's own ``hidden_out`` and last draft
token. Those speculative head entries are rolled back before the real features of the same
positions arrive. Draft ids map to target ids through ``d2t``. Greedy at temperature 0;
otherwise sampled, with ``q`` (the draft distribution scattered into the target vocabulary,
zero outside the draft vocabulary) returned for rejection sampling.

Not done here: tree drafting (EAGLE-2 dynamic trees), CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from outrider.kv_cache import SlotCache
from outrider.proposers.base import Draft, Outcome, Proposer, StartContext
from outrider.sampling import RowRandom, probs, sample


class Eagle3Proposer(Proposer):
    name = "eagle3"

    def __init__(self, head: torch.nn.Module, target: torch.nn.Module):
        self.head = head
        self.embedding = target.get_input_embeddings()
        self.vocab = target.get_output_embeddings().weight.shape[0]
        self.aux_layer_ids = tuple(head.config.aux_layer_ids)

    @classmethod
    def load(cls, path: str | Path, target: torch.nn.Module, device: torch.device | None = None) -> "Eagle3Proposer":
        from outrider.export import load_head

        head, _ = load_head(path, target_config=target.config)
        param = next(target.parameters())
        head = head.to(device=device or param.device, dtype=param.dtype).eval().requires_grad_(False)
        return cls(head, target)

    def start(self, ctx: StartContext) -> None:
        super().start(ctx)
        B = len(ctx.histories)
        self.dev = ctx.device
        self.cache = SlotCache(1, B, ctx.max_len, self.dev)
        self.rand = RowRandom(B, ctx.sampling.seed, stream=2)
        P = int(ctx.prompt_lens.max())
        # pairs (aux_t, x_{t+1}) for t = 0..P-1 of each prompt; x_P is the first emitted token
        nxt = torch.zeros(B, P, dtype=torch.long, device=self.dev)
        for b, h in enumerate(ctx.histories):
            n = int(ctx.prompt_lens[b])
            nxt[b, :n - 1] = torch.tensor(h[1:n], device=self.dev)
            nxt[b, n - 1] = ctx.last[b]
        valid = torch.arange(P, device=self.dev)[None, :] < ctx.prompt_lens[:, None]
        # right-align each row so that its newest pair is last
        shift = P - ctx.prompt_lens  # [batch]
        idx = (torch.arange(P, device=self.dev)[None, :] - shift[:, None]) % P
        self.pending = (ctx.target_aux.gather(1, idx[..., None].expand(-1, -1, ctx.target_aux.shape[-1])),
                        nxt.gather(1, idx), valid.gather(1, idx))
        self.spec_entries = 0

    def _draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # logits: [batch, draft_vocab] -> target ids [batch], q over the target vocab or None
        if self.ctx.sampling.greedy:
            return self.head.map_to_target(logits.argmax(-1)), None
        qd = probs(logits, self.ctx.sampling)  # [batch, draft_vocab]
        d = sample(qd, self.rand.uniform(1, qd.device)[:, 0])
        q = qd.new_zeros(qd.shape[0], self.vocab)
        q[:, self.head.map_to_target(torch.arange(qd.shape[1], device=qd.device))] = qd
        return self.head.map_to_target(d), q

    def _step(self, tokens: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Feed n positions per row (right-aligned); returns hidden_out [batch, n, H]."""
        # tokens: [batch, n] next-token ids; hidden: [batch, n, H]; valid: [batch, n]
        n = tokens.shape[1]
        positions = self.cache.lengths[:, None] + valid.long().cumsum(1) - 1
        self.cache.begin(n)
        causal = torch.ones(n, n, dtype=torch.bool, device=self.dev).tril()
        mask = self.cache.attention_mask(valid, causal, hidden.dtype)
        out = self.head.forward_hidden(self.embedding(tokens), hidden, positions.clamp_min(0), mask, self.cache)
        self.cache.commit(valid)
        return out

    @torch.no_grad()
    def propose(self, k: int) -> Draft:
        aux, nxt, valid = self.pending
        B = nxt.shape[0]
        h = self._step(nxt, self.head.fuse(aux.to(self.head.fc.weight.dtype)), valid)[:, -1:]  # [batch, 1, H]
        tokens, qs = [], []
        ones = torch.ones(B, 1, dtype=torch.bool, device=self.dev)
        for i in range(k):
            tok, q = self._draw(self.head.compute_logits(h[:, -1]))
            tokens.append(tok)
            qs.append(q)
            if i + 1 < k:
                h = self._step(tok[:, None], h, ones)
        self.spec_entries = k - 1
        q_all = None if qs[0] is None else torch.stack(qs, dim=1)  # [batch, k, vocab]
        return Draft(torch.stack(tokens, dim=1), torch.full((B,), k, device=self.dev), q_all)

    def observe(self, outcome: Outcome) -> None:
        B = outcome.tokens.shape[0]
        self.cache.rollback(torch.full((B,), self.spec_entries, device=self.dev))
        n_new = outcome.num_accepted + 1  # [batch] committed target positions this step
        n = outcome.tokens.shape[1]
        # right-align: row b's pairs are its first n_new[b] verify positions
        shift = n - n_new
        idx = (torch.arange(n, device=self.dev)[None, :] - shift[:, None]) % n
        valid = torch.arange(n, device=self.dev)[None, :] >= shift[:, None]
        aux = outcome.target_aux
        self.pending = (aux.gather(1, idx[..., None].expand(-1, -1, aux.shape[-1])),
                        outcome.tokens.gather(1, idx), valid)
