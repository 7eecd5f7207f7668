"""A preallocated KV cache addressed by slot, so that rejecting draft tokens costs nothing.

Contract: ``SlotCache`` is a ``transformers`` ``Cache``: a stock model writes its keys and values
(or, for MLA, its compressed latents) through ``update`` into preallocated slots chosen by the
caller. Every row of the batch owns the same slots; a per-row ``valid`` mask says which slots hold
committed tokens of that row. A rejected token is never cropped or copied: its slot is left invalid
(masked) or reused. Each row keeps its own ``lengths`` (the position id of its next token), so rows
may accept different numbers of tokens. ``attention_mask`` builds the additive 4-D mask of a step.
``read_len="max"`` hands attention the whole buffer (fixed shapes for graphs; the first free slot
then lives on the device), ``"used"`` only the slots written so far.

Not done here: paging, sharing prefixes between rows, eviction; running the model (``runner``).
The cache holds at most ``max_len`` slots; asking for more is a clear error, never an overwrite."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def static_cache(read_len: str, device: torch.device | str) -> bool:
    """Does a ``SlotCache`` with this ``read_len`` on ``device`` hand attention the whole buffer
    (``"max"``; ``"auto"`` on CUDA), keeping its first free slot on the device?"""
    if read_len not in ("used", "max", "auto"):
        raise ValueError(read_len)
    # "auto": fixed attention shapes on CUDA, no kernel re-planning per length
    return read_len == "max" or (read_len == "auto" and torch.device(device).type == "cuda")


class SlotLayer(CacheLayerMixin):
    """One decoder layer's buffers: keys/values ``[batch, heads, max_len, dim]``."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: "SlotCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> None:
        B, n = self.owner.rows, self.owner.max_len
        self.keys = key_states.new_zeros(B, key_states.shape[1], n, key_states.shape[3])
        self.values = value_states.new_zeros(B, value_states.shape[1], n, value_states.shape[3])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [batch, heads, n, dim] for the n new tokens of this forward
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.owner.write_slots  # [n]
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        end = self.owner.read_len
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.owner.read_len, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.owner.ptr

    def get_max_length(self) -> int:
        return self.owner.max_len

    def get_max_cache_shape(self) -> int:
        return self.owner.max_len

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()


class SlotCache(Cache):
    """Slot-addressed cache shared by all layers of one model for one batch of requests."""

    def __init__(self, num_layers: int, batch_size: int, max_len: int, device: torch.device | str,
                 read_len: str = "auto"):
        self.rows = batch_size
        self.max_len = max_len
        self.static = static_cache(read_len, device)
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # [batch, max_len]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [batch]
        self.ptr = 0  # first slot not yet written by a committed forward
        self.ptr_dev = torch.zeros((), dtype=torch.long, device=device)  # ptr at the last begin (static mode)
        self.n_pending = 0
        self.arange = torch.arange(max_len, device=device)
        self._eye = torch.eye(64, dtype=torch.bool, device=device)  # new tokens per forward <= 64
        self._slot_bufs: dict[int, torch.Tensor] = {}
        self.write_slots = self.arange[:0]
        self.read_len = max_len

    def begin(self, n: int) -> None:
        """Reserve slots ``[ptr, ptr + n)`` for the next forward."""
        if self.ptr + n > self.max_len:
            raise RuntimeError(f"KV cache full: {self.ptr} + {n} slots > max_len {self.max_len}")
        if self.static:  # one persistent index buffer per width: CUDA graphs read it by address
            buf = self._slot_bufs.get(n)
            if buf is None:
                buf = self._slot_bufs[n] = torch.arange(n, device=self.valid.device)
            self.ptr_dev.fill_(self.ptr)
            torch.add(self.arange[:n], self.ptr_dev, out=buf)
            self.write_slots = buf
        else:
            self.write_slots = self.arange[:n] + self.ptr
        self.read_len = self.max_len if self.static else self.ptr + n
        self.n_pending = n

    def attention_mask(self, query_valid: torch.Tensor, new_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[batch, 1, n, read_len]`` for the reserved forward.

        query_valid: [batch, n] bool, False for padding queries (whose outputs are ignored)
        new_mask:    [n, n] or [batch, n, n] bool, which new tokens each new token may see
        """
        B, n = query_valid.shape
        new = new_mask.expand(B, n, n) & query_valid[:, None, :]
        eye = self._eye[:n, :n] if n <= self._eye.shape[0] else torch.eye(n, dtype=torch.bool, device=new.device)
        new = new | eye  # a query always sees itself
        if self.static:  # slot arithmetic on the device: no host value enters (graph-capturable)
            rel = self.arange - self.ptr_dev  # [max_len] slot index relative to the first new slot
            inside = (rel >= 0) & (rel < n)
            cols = new.index_select(2, rel.clamp(0, n - 1))  # [batch, n, max_len]
            # committed slots of the row elsewhere; every slot >= ptr is invalid for every row
            allowed = torch.where(inside, cols, self.valid[:, None, :])
        else:
            p = self.ptr
            allowed = self.valid[:, None, :self.read_len].expand(B, n, self.read_len).clone()  # [batch, n, read_len]
            allowed[:, :, p:p + n] = new
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[:, None]

    def reset(self) -> None:
        """Forget every row's tokens (buffers and graphs stay allocated for the next batch)."""
        self.valid.zero_()
        self.lengths.zero_()
        self.ptr = 0
        self.n_pending = 0

    def commit(self, keep: torch.Tensor, used: int | None = None) -> None:
        """Keep, per row, the new tokens where ``keep`` [batch, n] is True.

        Kept tokens become visible to later forwards and advance the row's length. Slots after
        the last token kept by any row are released for the next forward; a caller that knows
        that count (``used``: 1 + the last kept index over all rows) spares a host sync.
        """
        n = self.n_pending
        assert keep.shape == (self.rows, n), (keep.shape, n)
        p = self.ptr
        self.valid[:, p:p + n] = keep
        self.lengths += keep.sum(dim=1)
        if used is None:
            cols = keep.any(dim=0).nonzero()
            used = int(cols.max()) + 1 if cols.numel() else 0
        self.ptr = p + used
        self.n_pending = 0

    def rollback(self, num: torch.Tensor) -> None:
        """Forget, per row, the last ``num[b]`` committed tokens (a draft model's rejected guesses)."""
        # from_end[b, s]: committed tokens of row b at slots >= s
        from_end = self.valid.flip(1).long().cumsum(1).flip(1)
        drop = self.valid & (from_end <= num[:, None])
        self.valid &= ~drop
        self.lengths -= drop.sum(dim=1)
        cols = self.valid.any(dim=0).nonzero()
        self.ptr = int(cols.max()) + 1 if cols.numel() else 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.ptr

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.read_len, 0

    def get_max_length(self) -> int:
        return self.max_len

    @property
    def is_compileable(self) -> bool:
        return True
