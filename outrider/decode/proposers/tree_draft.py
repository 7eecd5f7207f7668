"""Draft trees from an EAGLE-3 head: EAGLE-2 dynamic trees (SGLang's budget) and static trees
(vLLM's ``speculative_token_tree``).

Contract: ``TreeDrafter.draft(h_root, root_pos)`` starts from the head's ``hidden_out`` at the
root (the last committed pair, position ``root_pos``) and returns the nodes to verify: target
token ids ``[batch, N]`` and parent indices ``[batch, N]`` (parents before children). A level
costs one head forward over its expanded nodes (``topk`` of them for a dynamic tree), not one per
node. Their keys and values go to the head cache's tree slots (never committed; the next
``propose`` feeds the accepted path's real states), and a node sees the committed prefix, its
ancestors and itself, at position ``root_pos + depth``.

- Dynamic (``TreeBudget``, EAGLE-2 as SGLang builds it): scores are products of the draft's
  softmax probabilities along the path; the root's top-``topk`` children are expanded; each later
  level scores topk^2 children of the expanded nodes and expands the ``topk`` best; finally the
  ``draft_tokens - 1`` best candidates of all levels are kept (``outrider.ops.tree.select_nodes``).
- Static (``StaticTree``): a node of rank r is its parent's r-th likeliest draft token; every
  node with children is fed once, one head forward per level (the level's indices built once per
  tree and device: ``static_levels``; no loop over nodes in a round).
Drafted nodes are deterministic (top-k), so verification treats them as point masses.

Nothing in a round reads a value back to the host. Not done here: CUDA graphs of the drafting
levels (the shapes are static per tree; the capture is the proposer's), sampled (non-top-k) children.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from outrider.decode.proposers.head_cache import head_step
from outrider.ops.tree import select_nodes
from outrider.trees import StaticTree, TreeBudget, TreeSpec


def tree_slots(spec: TreeSpec) -> int:
    """Head-cache slots a round of this tree writes (one per fed node)."""
    if isinstance(spec, TreeBudget):
        return spec.topk * (spec.steps - 1)
    return spec.nodes


class TreeDrafter:
    """Drafts one tree per call through ``head`` over ``cache`` (a ``HeadCache`` with
    ``tree_base`` + ``tree_slots(spec)`` slots); ``embedding`` is the target's."""

    def __init__(self, head: torch.nn.Module, embedding: torch.nn.Module, cache: Any, spec: TreeSpec):
        self.head, self.embedding, self.cache, self.spec = head, embedding, cache, spec

    def _probs(self, h: torch.Tensor) -> torch.Tensor:
        # h: [batch, M, H] -> the draft's probabilities [batch, M, draft_vocab] (no temperature, as SGLang)
        return torch.softmax(self.head.compute_logits(h).float(), dim=-1)

    def _feed(self, tokens: torch.Tensor, hidden: torch.Tensor, depth: int, root_pos: torch.Tensor,
              slots: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
        """One head forward over M nodes of one depth -> their hidden_out [batch, M, H].

        tokens: [batch, M] target ids; hidden: [batch, M, H] their parents' hidden_out;
        root_pos: [batch]; slots: [batch, M] tree slots they write; sees: [batch, M, slots] bool,
        the tree slots each may attend (its ancestors' and its own)."""
        cache = self.cache
        positions = (root_pos[:, None] + depth).expand_as(tokens)  # [batch, M]
        cache.write = slots
        prefix = (cache.slots[None, None, :] <= root_pos[:, None, None]) & (cache.slots < cache.max_len)
        if cache.window:
            prefix = prefix & (cache.slots[None, None, :] > positions[:, :, None] - cache.window)
        return head_step(self.head, self.embedding, cache, tokens, hidden, positions, (prefix | sees)[:, None])

    @torch.no_grad()
    def draft(self, h_root: torch.Tensor, root_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h_root: [batch, 1, H]; root_pos: [batch] -> (tokens [batch, N], parents: [batch, N] for a
        dynamic tree, the static tree's [N] on the host)."""
        if isinstance(self.spec, TreeBudget):
            return self._dynamic(h_root, root_pos, self.spec)
        return self._static(h_root, root_pos, self.spec)

    def _dynamic(self, h_root: torch.Tensor, root_pos: torch.Tensor, spec: TreeBudget
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        K, B, dev = spec.topk, h_root.shape[0], h_root.device
        S = self.cache.keys.shape[2]
        base = self.cache.tree_base
        score, ids = self._probs(h_root)[:, 0].topk(K, dim=-1)  # [batch, K] level 1, best first
        tokens = self.head.map_to_target(ids)
        scores, cand_tokens, cand_parents = [score], [tokens], [torch.full((B, K), -1, device=dev)]
        front = torch.arange(K, device=dev).expand(B, K)  # [batch, K] candidate ids of the expanded nodes
        front_h = h_root.expand(B, K, -1)  # [batch, K, H] the hidden each was drawn from
        front_sees = torch.zeros(B, K, S, dtype=torch.bool, device=dev)
        n_cand = K
        for level in range(1, spec.steps):
            slots = (base + (level - 1) * K + torch.arange(K, device=dev)).expand(B, K)  # [batch, K]
            sees = front_sees.clone()
            sees.scatter_(2, slots[:, :, None], True)
            h = self._feed(tokens, front_h, level, root_pos, slots, sees)  # [batch, K, H]
            p, ids = self._probs(h).topk(K, dim=-1)  # [batch, K, K]
            cum = (score[:, :, None] * p).flatten(1)  # [batch, K^2] child c of expanded node r at r * K + c
            child_tokens = self.head.map_to_target(ids).flatten(1)
            scores.append(cum)
            cand_tokens.append(child_tokens)
            cand_parents.append(front[:, :, None].expand(B, K, K).flatten(1))
            if level + 1 < spec.steps:  # the best K children become the next expanded nodes
                score, pick = cum.topk(K, dim=-1)  # [batch, K]
                row = pick // K  # [batch, K] the expanded node each came from
                tokens = child_tokens.gather(1, pick)
                front = n_cand + pick
                front_h = h.gather(1, row[:, :, None].expand(-1, -1, h.shape[-1]))
                front_sees = sees.gather(1, row[:, :, None].expand(-1, -1, S))
            n_cand += K * K
        return select_nodes(torch.cat(scores, 1), torch.cat(cand_tokens, 1), torch.cat(cand_parents, 1),
                            spec.nodes)

    def _static(self, h_root: torch.Tensor, root_pos: torch.Tensor, tree: StaticTree
                ) -> tuple[torch.Tensor, torch.Tensor]:
        B, dev, N = h_root.shape[0], h_root.device, tree.nodes
        S = self.cache.keys.shape[2]
        tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
        hidden = h_root.new_zeros(B, 1 + N, h_root.shape[-1])  # [batch, 1 + N, H] hidden_out, root first
        hidden[:, 0] = h_root[:, 0]
        sees = torch.zeros(B, 1 + N, S, dtype=torch.bool, device=dev)  # [batch, 1 + N, slots] tree slots seen
        for depth, (nodes, heads, head_of, ranks, most, feed, fed_by) in enumerate(static_levels(tree, dev), 1):
            top = self._probs(hidden[:, heads]).topk(most, dim=-1).indices  # [batch, U, most]
            tokens[:, nodes] = self.head.map_to_target(top[:, head_of, ranks])  # [batch, L]
            if feed is None:
                continue
            slots = (self.cache.tree_base + feed).expand(B, -1)  # [batch, M]
            seen = sees[:, fed_by]  # [batch, M, slots] (a copy: advanced indexing)
            seen.scatter_(2, slots[:, :, None], True)
            hidden[:, feed + 1] = self._feed(tokens[:, feed], hidden[:, fed_by], depth, root_pos, slots, seen)
            sees[:, feed + 1] = seen
        return tokens, torch.tensor(tree.parents)


@functools.cache
def static_levels(tree: StaticTree, device: torch.device) -> tuple[tuple, ...]:
    """A static tree's levels as device indices, built once per tree and device: per depth (nodes
    [L], the positions whose draws they are (root 0, node i at i + 1) [U], each node's place among
    those [L], its rank [L], the most ranks drawn, the nodes with children [M] or None, and the
    positions those were drawn from [M])."""
    levels = []
    for depth in range(1, tree.steps + 1):
        nodes = tree.level(depth)
        heads = sorted({tree.parents[i] + 1 for i in nodes})
        feed = [i for i in nodes if i in set(tree.parents)]
        levels.append((
            torch.tensor(nodes, device=device), torch.tensor(heads, device=device),
            torch.tensor([heads.index(tree.parents[i] + 1) for i in nodes], device=device),
            torch.tensor([tree.ranks[i] for i in nodes], device=device), max(tree.ranks[i] for i in nodes) + 1,
            torch.tensor(feed, device=device) if feed else None,
            torch.tensor([tree.parents[i] + 1 for i in feed], device=device) if feed else None))
    return tuple(levels)
