"""EAGLE-3 drafting: a chain of k tokens from the head, fed with the target's own hidden states.

Contract: the head at position t reads the target's fused aux states at t and the token at t+1,
and predicts the token at t+2 (``heads.eagle3``). After every verification the target's aux
states of the committed positions, paired with the tokens that follow them, are *pending*; the
next ``propose`` feeds them to the head (ragged per row, right-aligned, padding masked), which
yields the first draft token; steps 2..k feed back the head's own ``hidden_out`` and last draft
token. Draft ids map to target ids through ``d2t``. Greedy at temperature 0; otherwise sampled,
with ``q`` (the draft distribution scattered into the target vocabulary, zero outside the draft
vocabulary) returned for rejection sampling.

The head's cache (``HeadCache``) is addressed by position: slot s of a row holds the entry of
position s, and a query at position p sees slots <= p. Entries of real positions are
committed (``lengths``); speculative entries of the chain sit past them and are overwritten by
the real features of the same positions, so a rejection needs no rollback and no host value
changes from step to step. On CUDA with ``graphs=True`` and greedy drafting, one ``propose``
(the pending step, k-1 chain steps, k draws) replays as one CUDA graph per (batch, k), and a
request's first one, over its prompt's block padded on the left to a multiple of 64 positions,
as one per (batch, width, k) (its pending step in eager kernels: a width met once); when the
engine compiles its step, ``torch.compile`` fuses the pending step (the alignment of the
verified pairs, then positions, slots, mask and the head's layer) and each greedy link of the
chain (a draw and the step that feeds it back) first.

With ``tree`` set, each round drafts a tree instead (``tree_draft``: EAGLE-2 or a static tree):
the pending step and every drafting level replay as one CUDA graph per (batch, width) when graphs
are on (the tree's shapes are static; its nodes are top-k, so sampled runs replay it too).

Not done here: graphs for sampled chains.
"""

from __future__ import annotations

import torch

from outrider.ops.graphs import capture_graph
from outrider.decode.draft import Draft
from outrider.decode.proposers.base import Outcome, Proposer, StartContext
from outrider.decode.proposers.head_cache import HeadCache, head_step
from outrider.decode.proposers.tree_draft import TreeDrafter, tree_slots
from outrider.decode.runner import PROMPT_BUCKET
from outrider.decode.sampling import RowRandom, probs, sample
from outrider.ops.tree import ancestors
from outrider.trees import StaticTree, TreeSpec

# With graphs a prompt's pending block is padded on the left to a multiple of PROMPT_BUCKET, like the target's
# prompt, and a request's first draft replays as a graph per width (eager, it costs about as much as a few
# rounds of drafting), up to
PROMPT_GRAPH_TOKENS = 4096  # batch x width positions,
PROMPT_GRAPHS_MAX = 16  # widths per batch size (eager beyond: each graph keeps its memory)


class Eagle3Proposer(Proposer):
    name = "eagle3"
    device_side = True
    device_rounds = True

    def __init__(self, head: torch.nn.Module, target: torch.nn.Module, tree: TreeSpec | None = None):
        self.head = head
        self.tree = tree  # draft trees of this shape instead of chains (``tree_draft``)
        self.embedding = target.get_input_embeddings()
        self.vocab = target.get_output_embeddings().weight.shape[0]
        self.aux_layer_ids = tuple(head.config.aux_layer_ids)
        self._pool: dict[int, tuple[HeadCache, dict]] = {}  # graph mode: batch size -> (cache, its graphs)
        self._offsets: list[torch.Tensor] = []  # chain offsets as tensors; graphs read them: never replaced
        self._static_shape: Draft | None = None  # a static tree's structure on the device (parents, ancestry)

    @classmethod
    def build(cls, target: torch.nn.Module, draft: torch.nn.Module = None, tree: TreeSpec | None = None,
              **options: object) -> "Eagle3Proposer":
        return cls(draft, target) if tree is None else cls(draft, target, tree=tree)

    def round_shape(self, k: int) -> tuple[int, int]:
        return (k, k) if self.tree is None else (self.tree.nodes, self.tree.steps)

    def start(self, ctx: StartContext) -> None:
        super().start(ctx)
        B = len(ctx.histories)
        self.dev = ctx.device
        self.use_graphs = ctx.graphs and self.dev.type == "cuda" and (ctx.sampling.greedy or self.tree is not None)
        old = self._pool.get(B) if self.use_graphs else None
        if old is not None and old[0].max_len >= ctx.max_len:
            self.cache, self._graphs = old  # reused with its graphs: stale entries sit past the lengths, masked
            self.cache.lengths.zero_()
        else:  # sized in steps of 512: graphs and compiled steps are reused by later requests
            size = -(-ctx.max_len // 512) * 512 if self.use_graphs or ctx.compile else ctx.max_len
            attn = self.head.midlayer.self_attn
            self.cache = HeadCache(B, size, attn.num_kv_heads, attn.head_dim, self.head.fc.weight.dtype, self.dev,
                                   v_head_dim=attn.v_head_dim, window=self.head.config.sliding_window,
                                   tree_slots=0 if self.tree is None else tree_slots(self.tree))
            self._graphs: dict[tuple[int, int, int, bool], tuple] = {}  # (batch, width, k, prompt) -> graph
            if self.use_graphs:  # one cache (and its graphs) per batch size
                self._pool[B] = (self.cache, self._graphs)
        self.rand = RowRandom(B, ctx.sampling.seed, stream=2)
        if self._offsets and self._offsets[0].device != self.dev:  # moved: graphs of the old device are not replayed
            self._offsets = []
        # the pending step, the greedy draw and link, the alignment: fused by torch.compile when the engine compiles
        self._body, self._greedy_draw, self._align, self._link = self.fused(
            ctx.compile, self._step_body, self._draw_greedy, _right_align, self._link_greedy)
        P = int(ctx.prompt_lens.max())
        # pairs (aux_t, x_{t+1}) for t = 0..P-1 of each prompt; x_P is the first emitted token
        nxt = torch.zeros(B, P, dtype=torch.long, device=self.dev)
        for b, h in enumerate(ctx.histories):
            n = int(ctx.prompt_lens[b])
            nxt[b, :n - 1] = torch.tensor(h[1:n], device=self.dev)
            nxt[b, n - 1] = ctx.last[b]
        self._prompt_pending = True  # the prompt's block: fed once, by the eager step (any width, never compiled)
        self.pending = _right_align(ctx.prompt_lens - 1, nxt, ctx.target_aux)  # each row's newest pair last
        width = -(-P // PROMPT_BUCKET) * PROMPT_BUCKET
        widths = {key[1] for key in self._graphs if key[3]} if self.use_graphs else set()
        self._prompt_graph = (self.use_graphs and B * width <= PROMPT_GRAPH_TOKENS  # a graph per (batch, width)
                              and (width in widths or len(widths) < PROMPT_GRAPHS_MAX))
        if self._prompt_graph:
            self.pending = _pad_left(self.pending, width)

    def _draw_greedy(self, h: torch.Tensor) -> torch.Tensor:
        # h: [batch, H] hidden_out -> the draft's argmax as target ids [batch]
        return self.head.map_to_target(self.head.compute_logits(h).argmax(-1))

    def _draw(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # h: [batch, H] hidden_out -> target ids [batch], q over the target vocab or None
        if self.ctx.sampling.greedy:
            return self._greedy_draw(h), None
        logits = self.head.compute_logits(h)  # [batch, draft_vocab]
        qd = probs(logits, self.ctx.sampling)  # [batch, draft_vocab]
        d = sample(qd, self.rand.uniform(1, qd.device)[:, 0])
        q = qd.new_zeros(qd.shape[0], self.vocab)
        q[:, self.head.map_to_target(torch.arange(qd.shape[1], device=qd.device))] = qd
        return self.head.map_to_target(d), q

    def _step(self, tokens: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor, ahead: int,
              eager: bool = False) -> torch.Tensor:
        """Feed n positions per row (right-aligned); returns the last one's hidden_out [batch, 1, H].

        ahead = 0: real pairs, committed (the row's next positions), ``hidden`` the target's aux
        states [batch, n, n_aux * H] (fused here); ahead = j >= 1: the j-th speculative chain
        entry, at the position j - 1 past the committed ones, not committed, ``hidden`` the
        head's own hidden_out [batch, 1, H]. ``eager``: the uncompiled step (a prompt's block,
        whose width compiling would cost more than it saves).
        """
        # tokens: [batch, n] next-token ids; valid: [batch, n]
        body = self._step_body if eager else self._body
        out = body(self.cache, tokens, hidden, valid, self._offset(max(ahead - 1, 0)), ahead == 0)
        if ahead == 0:
            self.cache.lengths += valid.sum(1)
        return out

    def _offset(self, j: int) -> torch.Tensor:
        """``j`` as a device tensor [1], one per value: a compiled step sees tensors, not ints."""
        while len(self._offsets) <= j:
            self._offsets.append(torch.full((1,), len(self._offsets), dtype=torch.long, device=self.dev))
        return self._offsets[j]

    def _step_body(self, cache: HeadCache, tokens: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor,
                   offset: torch.Tensor, fuse: bool) -> torch.Tensor:
        """Positions, cache slots, mask and the head's layer of one step (compiled: the pending
        step alone, a greedy chain step inside ``_link_greedy``): the keys and values of every
        position enter the cache, and only the last position is attended from and carried on
        (the right-aligned newest pair: the only hidden_out the chain reads)."""
        if fuse:
            hidden = self.head.fuse(hidden.to(self.head.fc.weight.dtype))  # [batch, n, H]
        positions = cache.place(valid, offset)  # [batch, n]
        mask = cache.mask(positions[:, -1:], valid[:, -1:])  # [batch, 1, 1, slots]
        return head_step(self.head, self.embedding, cache, tokens, hidden, positions, mask)  # [batch, 1, H]

    def _link_greedy(self, cache: HeadCache, h: torch.Tensor, ones: torch.Tensor, offset: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy link of the chain, one compiled function: the draw from h [batch, 1, H],
        then the step that feeds it back -> (token [batch], the next h [batch, 1, H])."""
        tok = self._draw_greedy(h[:, -1])
        return tok, self._step_body(cache, tok[:, None], h, ones, offset, False)

    def _chain(self, aux: torch.Tensor, nxt: torch.Tensor, valid: torch.Tensor, k: int, prompt: bool = False):
        """The pending step (eager for a prompt's block) then k draws: (tokens [batch, k], q [batch,
        k, vocab] or None)."""
        h = self._step(nxt, aux, valid, 0, eager=prompt)  # [batch, 1, H]
        B = nxt.shape[0]
        tokens, qs = [], []
        ones = torch.ones(B, 1, dtype=torch.bool, device=nxt.device)
        if self.ctx.sampling.greedy:
            for i in range(k - 1):
                tok, h = self._link(self.cache, h, ones, self._offset(i))
                tokens.append(tok)
            tokens.append(self._greedy_draw(h[:, -1]))
            return torch.stack(tokens, dim=1), None
        for i in range(k):
            tok, q = self._draw(h[:, -1])
            tokens.append(tok)
            qs.append(q)
            if i + 1 < k:
                h = self._step(tok[:, None], h, ones, i + 1)
        return torch.stack(tokens, dim=1), None if qs[0] is None else torch.stack(qs, dim=1)

    def _round(self, aux: torch.Tensor, nxt: torch.Tensor, valid: torch.Tensor, k: int, prompt: bool
               ) -> tuple[torch.Tensor | None, ...]:
        """A round's drafting: the chain's (tokens [batch, k], q or None), or with a tree its (tokens
        [batch, N], parents, ancestors, depths) (``_tree``)."""
        return self._chain(aux, nxt, valid, k, prompt) if self.tree is None else self._tree(aux, nxt, valid, prompt)

    def _tree(self, aux: torch.Tensor, nxt: torch.Tensor, valid: torch.Tensor, prompt: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The pending step, then a tree of ``self.tree``'s shape from its hidden_out: (tokens [batch,
        N], parents, ancestors [batch, N, N], depths [batch, N]) for a dynamic tree, whose ancestry is
        built here (within the round's graph); (tokens, the static tree's parents [N] on the host, None,
        None) for a static one (its ancestry is built once per request: ``_tree_draft``)."""
        h = self._step(nxt, aux, valid, 0, eager=prompt)  # [batch, 1, H] at the last committed pair
        tokens, parents = TreeDrafter(self.head, self.embedding, self.cache, self.tree).draft(h, self.cache.lengths - 1)
        if isinstance(self.tree, StaticTree):
            return tokens, parents, None, None
        anc = ancestors(parents, self.tree.steps)  # [batch, N, N]
        return tokens, parents, anc, anc.sum(-1)

    def _replay(self, aux: torch.Tensor, nxt: torch.Tensor, valid: torch.Tensor, k: int, prompt: bool) -> tuple:
        """``_round`` as a CUDA graph captured once per (batch, width, k, prompt): its outputs (static
        buffers, rewritten by the next replay)."""
        key = (nxt.shape[0], nxt.shape[1], k, prompt)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(aux, nxt, valid, k, prompt)
            self._graphs[key] = entry
        graph, s_aux, s_nxt, s_valid, out = entry
        s_aux.copy_(aux)
        s_nxt.copy_(nxt)
        s_valid.copy_(valid)
        graph.replay()
        return out

    def _capture(self, aux, nxt, valid, k, prompt):
        s_aux, s_nxt, s_valid = aux.clone(), nxt.clone(), valid.clone()
        saved = self.cache.lengths.clone()
        # warm-up writes land past the committed entries and the lengths are restored after each run
        graph, out = capture_graph(lambda: self._round(s_aux, s_nxt, s_valid, k, prompt), self.dev,
                                   warmups=2, after_each=lambda: self.cache.lengths.copy_(saved))
        self.cache.lengths.copy_(saved)  # capture recorded the kernels without running them
        return graph, s_aux, s_nxt, s_valid, out

    @torch.no_grad()
    def propose(self, k: int) -> Draft:
        aux, nxt, valid = self.pending
        B = nxt.shape[0]
        self._offset(max(k - 2, 0))  # the chain's offsets exist before any graph is captured
        prompt, self._prompt_pending = self._prompt_pending, False
        # after the first step every pending block is one wider than the deepest draft; a prompt's is padded (``start``)
        if self.use_graphs and (self._prompt_graph if prompt else nxt.shape[1] == self.round_shape(k)[1] + 1):
            out = self._replay(aux, nxt, valid, k, prompt)
            out = out if self.tree is not None else (out[0], None)
        else:
            out = self._round(aux, nxt, valid, k, prompt)
        if self.tree is not None:
            return self._tree_draft(*out)
        return Draft.chain(out[0], torch.full((B,), k, device=self.dev), out[1])

    def _tree_draft(self, tokens: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor | None,
                    depths: torch.Tensor | None) -> Draft:
        """A drafted tree (``_tree``'s outputs) as the round's ``Draft``: top-k nodes, verified as
        point masses."""
        nodes, steps = self.tree.nodes, self.tree.steps
        num = torch.full((tokens.shape[0],), nodes, device=self.dev)
        if isinstance(self.tree, StaticTree):  # one shape for every row: its ancestry computed once per request
            if self._static_shape is None or self._static_shape.tokens.device != self.dev:
                self._static_shape = Draft(tokens, parents, num, depth=steps, width=self.tree.topk)
            shape = self._static_shape
            return Draft(tokens, shape.parents, num, depth=steps, width=shape.width, ancestors=shape.ancestors,
                         depths=shape.depths)
        return Draft(tokens, parents, num, None, depth=steps, width=self.tree.topk, ancestors=anc, depths=depths)

    def propose_device(self, k: int) -> torch.Tensor:
        """The greedy chain as plain device operations: draft tokens [batch, k] (no graph of its own)."""
        self._offset(max(k - 2, 0))
        prompt, self._prompt_pending = self._prompt_pending, False
        return self._chain(*self.pending, k, prompt)[0]

    def device_state(self) -> list[torch.Tensor]:
        return [self.cache.lengths]

    def device_anchor(self) -> object:
        return self.cache

    def observe(self, outcome: Outcome) -> None:
        self.pending = self._align(outcome.num_accepted, outcome.tokens, outcome.target_aux)


def _pad_left(block: tuple[torch.Tensor, torch.Tensor, torch.Tensor], width: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A right-aligned pending block (aux [batch, n, n_aux * H], tokens [batch, n], valid [batch, n])
    padded on the left to ``width`` positions; the padding is not valid (it changes no head output)."""
    aux, tokens, valid = block
    pad = width - tokens.shape[1]
    return (torch.nn.functional.pad(aux, (0, 0, pad, 0)), torch.nn.functional.pad(tokens, (pad, 0)),
            torch.nn.functional.pad(valid, (pad, 0), value=False))


def _right_align(n_acc: torch.Tensor, tokens: torch.Tensor, aux: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Committed pairs as the head's pending block (a verification's, or a prompt's with n_acc =
    its length - 1): row b's first n_acc[b] + 1 positions, right-aligned. n_acc [batch]; tokens [batch, n]; aux [batch, n, n_aux * H] ->
    (aux, tokens, valid [batch, n] bool), the padding on the left."""
    n = tokens.shape[1]
    shift = n - (n_acc + 1)  # [batch]
    ar = torch.arange(n, device=tokens.device)
    idx = (ar[None, :] - shift[:, None]) % n  # [batch, n]
    valid = ar[None, :] >= shift[:, None]
    return aux.gather(1, idx[..., None].expand(-1, -1, aux.shape[-1])), tokens.gather(1, idx), valid
