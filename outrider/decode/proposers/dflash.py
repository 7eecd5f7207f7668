"""DFlash drafting: a whole chain of k tokens from one forward of a block drafter (``heads.dflash``).

Contract: the drafter keeps, per row, the keys and values of every draft layer for the committed
context (``DFlashCache``: slot s holds position s). ``start`` writes the prompt's aux states
(positions ``0 .. P-1``); each ``observe`` writes those of the round's root and accepted drafts at
the next positions (the states the target computed while verifying), so the context always ends
just before the newest committed token ``x_p`` (the round's bonus or correction). ``propose(k)``
runs one forward over the block ``[x_p, mask * k]`` at positions ``p .. p+k``, the block's
queries seeing the context slots ``< p`` and each other, as vLLM's DFlash proposer builds it
(bonus query then K mask queries; ``qwen3_dflash.py``); the outputs at the k masks give
``d_1 .. d_k``: greedy through ``d2t``, or each drawn from its own softmax with ``q`` returned. ``k``
is at most ``block_size - 1`` (the block the drafter was trained on). Every update is an in-place
device operation (``device_side``, ``device_rounds``).

On CUDA with ``graphs=True`` and greedy drafting, ``propose`` replays the forward and its argmax
as one CUDA graph per (batch, k); the cache (sized in steps of 512 positions) and its graphs are
kept per batch size for later requests, as the EAGLE-3 proposer keeps its own. When the engine
compiles its step, ``torch.compile`` fuses the greedy block forward (with its argmax) and a
round's ``observe`` (the context's keys and values, their cache writes, the newest token) first,
each once per static shape; the prompt's context is written eagerly (a width met once).

Not done here: trees.
"""

from __future__ import annotations

import torch

from outrider.decode.draft import Draft
from outrider.decode.proposers.base import Outcome, Proposer, StartContext
from outrider.decode.proposers.parallel import block_draws
from outrider.decode.sampling import RowRandom
from outrider.errors import UserError
from outrider.heads.dflash import DFlashDrafter
from outrider.ops.graphs import capture_graph


class DFlashCache:
    """Keys and values ``[layers, batch, kv_heads, slots, head_dim]``; slot ``max_len`` is scratch
    (padding and positions past ``max_len`` write there; no query sees it)."""

    def __init__(self, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.max_len = max_len
        self.keys = torch.zeros(layers, batch, kv_heads, max_len + 1, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [batch] committed positions
        self.last = torch.zeros(batch, dtype=torch.long, device=device)  # [batch] newest token, not in the context
        self.slots = torch.arange(max_len + 1, device=device)

    def write(self, kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor, valid: torch.Tensor) -> None:
        """kv: per layer (k, v) [batch, kv_heads, n, d] of positions [batch, n] (valid [batch, n])."""
        slot = torch.where(valid & (positions < self.max_len), positions, self.max_len)  # [batch, n]
        for layer, (k, v) in enumerate(kv):
            idx = slot[:, None, :, None].expand_as(k)
            self.keys[layer].scatter_(2, idx, k.to(self.keys.dtype))
            self.values[layer].scatter_(2, idx, v.to(self.values.dtype))
        self.lengths += valid.sum(1)

    def mask(self, m: int) -> torch.Tensor:
        """Bool ``[batch, 1, m, slots + m]``: the committed slots, then the block's m keys."""
        sees = self.slots[None, :] < self.lengths[:, None]  # [batch, slots]
        B = sees.shape[0]
        block = sees.new_ones(B, m)
        return torch.cat([sees, block], dim=1)[:, None, None, :].expand(B, 1, m, -1)


class DFlashProposer(Proposer):
    name = "dflash"
    device_side = True
    device_rounds = True

    def __init__(self, drafter: DFlashDrafter, target: torch.nn.Module):
        self.drafter = drafter
        self.embedding = target.get_input_embeddings()
        self.vocab = target.get_output_embeddings().weight.shape[0]
        self.aux_layer_ids = tuple(drafter.config.aux_layer_ids)
        self._pool: dict[int, tuple[DFlashCache, dict]] = {}  # graph mode: batch size -> (cache, graphs by k)

    @classmethod
    def build(cls, target: torch.nn.Module, draft: DFlashDrafter = None, **options: object) -> "DFlashProposer":
        return cls(draft, target)

    def start(self, ctx: StartContext) -> None:
        super().start(ctx)
        cfg, dev = self.drafter.config, ctx.device
        B = len(ctx.histories)
        self.dev = dev
        self.use_graphs = ctx.graphs and dev.type == "cuda" and ctx.sampling.greedy
        old = self._pool.get(B) if self.use_graphs else None
        if old is not None and old[0].max_len >= ctx.max_len:
            self.cache, self._graphs = old  # stale entries sit past the lengths: never seen
            self.cache.lengths.zero_()
        else:
            size = -(-ctx.max_len // 512) * 512 if self.use_graphs or ctx.compile else ctx.max_len
            self.cache = DFlashCache(cfg.num_hidden_layers, B, size, cfg.num_key_value_heads, cfg.head_dim,
                                     self.drafter.fc.weight.dtype, dev)
            self._graphs: dict[int, tuple] = {}
            if self.use_graphs:
                self._pool[B] = (self.cache, self._graphs)
        self.rand = RowRandom(B, ctx.sampling.seed, stream=2)
        self._greedy, self._observe = self.fused(ctx.compile, self._greedy_eager, self._observe_eager)
        self.cache.last.copy_(ctx.last.to(dev))
        W = ctx.target_aux.shape[1]
        positions = torch.arange(W, device=dev)[None, :].expand(B, W)
        valid = positions < ctx.prompt_lens.to(dev)[:, None]  # [batch, W]: right padding
        self._commit(ctx.target_aux, positions, valid)

    def _commit(self, aux: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        # aux: [batch, n, n_aux * H_t]; positions, valid: [batch, n]
        self.cache.write(self.drafter.context_kv(aux, positions), positions, valid)

    def _check_k(self, k: int) -> None:
        cfg = self.drafter.config
        if not 1 <= k <= cfg.max_draft:
            raise UserError(f"this DFlash drafter drafts at most {cfg.max_draft} tokens per round (block_size "
                            f"{cfg.block_size}): use k in 1..{cfg.max_draft}")

    def _forward(self, k: int) -> torch.Tensor:
        """Draft logits [batch, k, draft_vocab] of the block [x_p, mask * k] at positions p .. p+k."""
        cfg = self.drafter.config
        self._check_k(k)
        last = self.cache.last
        tokens = torch.cat([last[:, None], last.new_full((last.shape[0], k), cfg.mask_token_id)], dim=1)  # [B, k+1]
        positions = self.cache.lengths[:, None] + torch.arange(k + 1, device=self.dev)  # [B, k+1]
        with torch.no_grad():
            embeds = self.embedding(tokens)  # [B, k+1, H]
        ctx = [(self.cache.keys[i], self.cache.values[i]) for i in range(cfg.num_hidden_layers)]
        h = self.drafter.block(embeds, positions, ctx, self.cache.mask(k + 1))  # [B, k+1, H]
        return self.drafter.compute_logits(h[:, 1:])

    def _greedy_eager(self, k: int) -> torch.Tensor:
        # the greedy drafts [batch, k] as target ids
        return self.drafter.map_to_target(self._forward(k).argmax(-1))

    @torch.no_grad()
    def propose(self, k: int) -> Draft:
        if self.use_graphs:
            if k not in self._graphs:
                self._check_k(k)  # a k past the block is refused before anything is compiled or captured
                self._graphs[k] = capture_graph(lambda: self._greedy(k), self.dev, warmups=2)
            graph, tokens = self._graphs[k]
            graph.replay()
            return Draft.chain(tokens.clone(), torch.full((tokens.shape[0],), k, device=self.dev), None)
        tokens, q = block_draws(self._forward(k), self.drafter.map_to_target, self.ctx.sampling, self.rand,
                                self.vocab)
        return Draft.chain(tokens, torch.full((tokens.shape[0],), k, device=self.dev), q)

    @torch.no_grad()
    def propose_device(self, k: int) -> torch.Tensor:
        """Greedy draft tokens [batch, k] as plain device operations."""
        self._check_k(k)
        return self._greedy(k)

    @torch.no_grad()
    def observe(self, outcome: Outcome) -> None:
        self._observe(outcome.target_aux, outcome.tokens.to(self.dev), outcome.num_accepted.to(self.dev))

    def _observe_eager(self, aux: torch.Tensor, tokens: torch.Tensor, n_acc: torch.Tensor) -> None:
        # aux [batch, D+1, n_aux * H_t] of the round's verified tokens [batch, D+1]; n_acc [batch] accepted drafts
        j = torch.arange(tokens.shape[1], device=self.dev)
        positions = self.cache.lengths[:, None] + j  # [batch, D+1]: the root's position, then its accepted drafts'
        self._commit(aux, positions, j[None, :] <= n_acc[:, None])
        self.cache.last.copy_(tokens.gather(1, n_acc[:, None])[:, 0])

    def device_state(self) -> list[torch.Tensor]:
        return [self.cache.lengths, self.cache.last]

    def device_anchor(self) -> object:
        return self.cache
