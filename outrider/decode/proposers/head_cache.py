"""The EAGLE-3 head's KV cache during drafting, and the one head step every head proposer runs over it.

Contract: ``HeadCache`` holds the keys and values of the head's single layer, addressed by
position (slot s of a row holds position s; a query at p sees slots <= p), with scratch and tree
slots past ``max_len``; ``place(valid, offset)`` gives a right-aligned block's positions and points
its writes there (padding to the scratch slot). ``head_step(head, embedding, cache, tokens,
hidden, positions, mask)``: one forward of the head's layer over a block (every position's keys
and values enter the cache at ``cache.write``), of which the last ``mask.shape[2]`` positions
attend and come out. The chain (``eagle3``), parallel drafting (``parallel``) and trees
(``tree_draft``) differ only in the positions, slots and mask they give it.

Not done here: committing (the proposers move ``lengths``), the head's layer itself (``heads``).
"""

from __future__ import annotations

import torch

SLOT_ALIGN = 64  # the head cache's slot count is a multiple of this: an odd count draws an unaligned (slow) GEMM
# for the draft step's scores


class HeadCache:
    """Keys ``[batch, kv_heads, slots, head_dim]`` and values ``[batch, kv_heads, slots, v_head_dim]``
    of the head's single layer (an MLA head's per-head keys and values), ``slots`` the first
    multiple of ``SLOT_ALIGN`` above ``max_len``.

    Slot ``s < max_len`` holds position ``s``; slot ``max_len`` is scratch for padding entries;
    ``tree_slots`` slots after it hold a draft tree's nodes (``tree_draft``); the slots after those
    stay masked. ``write`` sets where the next ``update`` scatters (``[batch, n]``
    slots). The buffers exist from the start, so a compiled step sees the same tensors (and
    guards) on every call. ``window`` > 0: a query at p sees slots p - window + 1 .. p only.
    """

    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, v_head_dim: int | None = None, window: int = 0, tree_slots: int = 0):
        self.max_len, self.window = max_len, window
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [batch] committed positions
        self.tree_base = max_len + 1  # a draft tree's nodes write slots tree_base.. (seen by their descendants only)
        self.tree_slots = tree_slots
        size = -(-(max_len + 1 + tree_slots) // SLOT_ALIGN) * SLOT_ALIGN  # slots past these are never seen
        self.slots = torch.arange(size, device=device)  # [size]
        self.write: torch.Tensor | None = None
        self.keys = torch.zeros(batch, kv_heads, size, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch, kv_heads, size, v_head_dim or head_dim, dtype=dtype, device=device)

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        # k: [batch, kv_heads, n, head_dim]; v: [batch, kv_heads, n, v_head_dim]
        idx = self.write[:, None, :, None]
        self.keys.scatter_(2, idx.expand_as(k), k)
        self.values.scatter_(2, idx.expand_as(v), v)
        return self.keys, self.values

    def mask(self, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Boolean mask ``[batch, 1, n, slots]``: a real query at p sees slots <= p."""
        # positions, valid: [batch, n]
        sees = self.slots[None, None, :] <= positions[:, :, None]
        sees &= self.slots[None, None, :] < self.max_len
        if self.window:
            sees &= self.slots[None, None, :] > positions[:, :, None] - self.window
        scratch = (self.slots == self.max_len)[None, None, :] & ~valid[:, :, None]  # padding sees scratch only
        return torch.where(valid[:, :, None], sees, scratch)[:, None]

    def place(self, valid: torch.Tensor, offset: torch.Tensor | int = 0) -> torch.Tensor:
        """A right-aligned block's positions [batch, n] (valid: [batch, n], padding on the left): the
        row's next committed positions, ``offset`` further on; its writes go there, padding's to
        the scratch slot."""
        before = valid.long().cumsum(1) if valid.shape[1] > 1 else valid.long()  # [batch, n] real entries up to each
        positions = self.lengths[:, None] + before - 1 + offset  # [batch, n]
        self.write = torch.where(valid, positions, self.max_len)
        return positions


def head_step(head: torch.nn.Module, embedding: torch.nn.Module, cache: HeadCache, tokens: torch.Tensor,
              hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """tokens: [batch, m] target ids; hidden: [batch, m, H] fused aux states or hidden_out;
    positions: [batch, m]; mask: [batch, 1, n, slots] for the last n positions -> their
    hidden_out [batch, n, H]. Every position's keys and values enter ``cache`` at ``cache.write``."""
    n = mask.shape[2]
    q, k, v = head.before_attention(embedding(tokens), hidden, positions.clamp_min(0))
    attended = head.attend(q[:, :, -n:], k, v, mask, cache)  # [batch, n, heads * d_v]
    return head.after_attention(hidden[:, -n:], attended)
