"""The DFlash training objective: blocks anchored along the sequence, the whole block in one forward.

Contract. Notation as in ``ttt``: ``x_0..x_{S-1}``, ``a_t`` the target's aux states at ``t``,
``teacher[t]`` its prediction of ``x_{t+1}``. A block *anchored* after position ``t`` is what the
drafter sees once the target has produced ``x_{t+1}`` from the states up to ``t``: the context
``a_0..a_t`` and the block ``[x_{t+1}, mask, ..., mask]`` at positions ``t+1 .. t+m`` (``m`` =
``block_size``). Its output at block position ``i + 1`` is draft ``i`` (``i = 0..m-2``), the
prediction of ``x_{t+2+i}``: the same ``(t, i)`` as TTT step ``i`` at ``t``, so the trainer's
position sets (``ttt.counted_positions``), metrics and ``walked_accept_len`` apply unchanged.

- Anchors: every counted ``t`` in evaluation; in training, ``sample_anchors`` keeps at most
  ``num_anchors`` per row, drawn uniformly from a seeded generator on the host (SpecForge draws
  512 anchors per sequence the same way), so every rank knows the global counts before a forward.
- Attention: a block's queries see the context keys of real positions ``<= t`` and every key of
  their own block; blocks never see each other. Blocks run ``chunk`` anchors at a time (one dense
  SDPA over [context | the chunk's blocks] per layer).
- Loss: the method's (DFlash, arXiv 2602.06036): cross-entropy of the drafter's distribution
  against the sequence's token ``x_{t+2+i}`` (``labels="tokens"``: hard labels; a label outside the
  draft vocabulary cannot be drafted and adds no loss), or with ``labels="target"`` against
  ``softmax(teacher[t+1+i])``, the target's own distribution there (soft labels, as EAGLE-3 trains);
  weighted ``exp(-i / gamma)`` by the caller's ``weights`` (``decay_weights``), summed or averaged
  per step as ``ttt_loss`` does.
- Metrics: as ``ttt``: ``per_step_acc[i]`` is agreement of the drafter's argmax with the
  teacher's argmax over the draft vocabulary, ``agree`` the per-position map.

Not done here: optimisation (``trainer``), the drafter (``heads.dflash``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.nn import functional as F

from outrider.config import DFLASH_LABELS
from outrider.heads.dflash import DFlashDrafter
from outrider.train.data.vocab import draft_lookup
from outrider.train.loop.ttt import TTTOutput, counted_positions, simulated_accept_len, soft_cross_entropy
from outrider.train.states.capture import real_positions

CHUNK = 64  # anchors per dense attention call


def sample_anchors(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None, steps: int, num_anchors: int,
                   seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``counted_positions`` restricted to at most ``num_anchors`` anchors ``t`` per row, drawn
    uniformly without replacement (host tensors; the same ``seed`` draws the same)."""
    generator = torch.Generator().manual_seed(seed)
    index = counted_positions(loss_mask, attention_mask, steps)
    B, S = loss_mask.shape
    any_step = torch.zeros(B, S, dtype=torch.bool)
    for b, t in index:
        any_step[b, t] = True
    keep = torch.zeros(B, S, dtype=torch.bool)
    for row in range(B):
        candidates = any_step[row].nonzero()[:, 0]
        if len(candidates) > num_anchors:
            candidates = candidates[torch.randperm(len(candidates), generator=generator)[:num_anchors]]
        keep[row, candidates] = True
    return [(b[keep[b, t]], t[keep[b, t]]) for b, t in index]


def _anchors(index: Sequence[tuple[torch.Tensor, torch.Tensor]], B: int, S: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(anchors [B, N] ascending, valid [B, N], counted [steps, B, S]) from the steps' position sets."""
    counted = torch.zeros(len(index), B, S, dtype=torch.bool, device=device)
    for i, (b, t) in enumerate(index):
        counted[i, b, t] = True
    mark = counted.any(0)  # [B, S]
    n = mark.sum(1)  # [B]
    N = max(int(n.max()), 1)
    order = torch.sort((~mark).to(torch.int8), dim=1, stable=True).indices[:, :N]  # marked t's first, ascending
    valid = torch.arange(N, device=device)[None, :] < n[:, None]
    return torch.where(valid, order, 0), valid, counted


def dflash_loss(drafter: DFlashDrafter, embed: Callable[[torch.Tensor], torch.Tensor], aux: torch.Tensor,
                input_ids: torch.Tensor, loss_mask: torch.Tensor, teacher: torch.Tensor,
                attention_mask: torch.Tensor | None, weights: Sequence[float],
                reduction: str = "mean", index: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
                agree_map: bool = False, chunk: int = CHUNK, labels: str = "tokens") -> TTTOutput:
    """The DFlash loss and metrics of one batch (module docstring).

    aux: [B, S, n_aux * H_t]; input_ids, loss_mask, attention_mask: [B, S]; teacher: [B, S, draft_vocab];
    weights: per draft position (``TrainConfig.step_weights``); index: the positions per
    draft position (default: every counted position, ``counted_positions``).
    """
    cfg = drafter.config
    steps = cfg.block_size - 1
    B, S = input_ids.shape
    device = input_ids.device
    if aux.shape[:2] != (B, S) or teacher.shape != (B, S, cfg.draft_vocab_size):
        raise ValueError(f"shapes disagree: input_ids {tuple(input_ids.shape)}, aux {tuple(aux.shape)}, "
                         f"teacher {tuple(teacher.shape)} (draft vocab {cfg.draft_vocab_size})")
    if labels not in DFLASH_LABELS:
        raise ValueError(f"labels must be one of {DFLASH_LABELS}, got {labels!r}")
    real = torch.ones(B, S, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
    if index is None:
        index = counted_positions(loss_mask, real, steps)
    if len(index) != steps:
        raise ValueError(f"{len(index)} position sets for {steps} draft positions (block_size {cfg.block_size})")
    w = list(weights)
    anchors, valid, counted = _anchors(index, B, S, device)
    positions = real_positions(real)  # [B, S]
    ctx = drafter.context_kv(aux, positions)  # per layer [B, kv, S, d] x 2
    to_draft = draft_lookup(drafter.map_to_target(torch.arange(cfg.draft_vocab_size, device=device)), cfg.vocab_size)
    m = cfg.block_size
    offs = torch.arange(m, device=device)
    with torch.no_grad():
        mask_embed = embed(torch.full((1, 1), cfg.mask_token_id, dtype=torch.long, device=device))  # [1, 1, H]
    ce_sum = [aux.new_zeros((), dtype=torch.float32) for _ in range(steps)]
    correct = [torch.zeros((), dtype=torch.long, device=device) for _ in range(steps)]
    counts = [int(b.numel()) for b, _ in index]
    flags = torch.zeros(steps, B, S, dtype=torch.bool, device=device) if agree_map else None
    keys = torch.arange(S, device=device)
    for j in range(0, anchors.shape[1], chunk):
        t = anchors[:, j: j + chunk]  # [B, c]
        c = t.shape[1]
        with torch.no_grad():
            first = embed(input_ids.gather(1, (t + 1).clamp(max=S - 1)))  # [B, c, H]: x_{t+1}
        embeds = torch.cat([first[:, :, None], mask_embed[:, :, None].expand(B, c, m - 1, -1).to(first.dtype)],
                           dim=2).flatten(1, 2)  # [B, c*m, H]
        pos = (positions.gather(1, t)[:, :, None] + 1 + offs).flatten(1)  # [B, c*m]
        sees_ctx = (keys[None, None, :] <= t[:, :, None]) & real[:, None, :]  # [B, c, S]
        sees_ctx = sees_ctx[:, :, None].expand(B, c, m, S).reshape(B, c * m, S)
        blocks = torch.arange(c, device=device).repeat_interleave(m)  # [c*m]
        sees_blk = (blocks[:, None] == blocks[None, :]).expand(B, -1, -1)  # [B, c*m, c*m]
        mask = torch.cat([sees_ctx, sees_blk], dim=-1)[:, None]  # [B, 1, c*m, S + c*m]
        h = drafter.block(embeds, pos, ctx, mask).view(B, c, m, -1)  # [B, c, m, H]
        for i in range(steps):
            sel = counted[i].gather(1, t) & valid[:, j: j + chunk]  # [B, c]
            rows, cols = sel.nonzero(as_tuple=True)  # possibly none: the loss stays a function of every weight
            tt = t[rows, cols]
            logits = drafter.compute_logits(h[rows, cols, i + 1]).float()  # [n, draft_vocab]
            target = teacher[rows, tt + 1 + i]  # [n, draft_vocab]: the target's logits for x_{t+2+i}
            if labels == "target":
                ce = soft_cross_entropy(logits, target)[0]
            else:
                label = to_draft[input_ids[rows, tt + 2 + i]]  # [n]: x_{t+2+i} in draft ids, -1 outside
                ce = F.cross_entropy(logits, label.clamp_min(0), reduction="none") * (label >= 0)
            ce_sum[i] = ce_sum[i] + ce.sum()
            agree = logits.detach().argmax(-1) == target.argmax(-1)
            correct[i] = correct[i] + agree.sum()
            if agree_map:
                flags[i, rows, tt] = agree
    total = sum(wi * (s / max(n, 1) if reduction == "mean" else s) for wi, s, n in zip(w, ce_sum, counts))
    acc = torch.stack([cr.double() / max(n, 1) for cr, n in zip(correct, counts)])
    return TTTOutput(loss=total, per_step_loss=torch.stack([s.detach() / max(n, 1) for s, n in zip(ce_sum, counts)]),
                     per_step_acc=acc.float(), sim_accept_len=simulated_accept_len(acc), n_tokens=counts[0],
                     per_step_tokens=torch.tensor(counts, dtype=torch.long), per_step_correct=torch.stack(correct),
                     agree=flags)


class DFlashModule(torch.nn.Module):
    """``dflash_loss`` as a module whose ``forward`` a distributed wrapper can own (``ttt.TTTModule``'s
    calling convention, so the trainer drives both alike)."""

    def __init__(self, drafter: DFlashDrafter, embed: Callable[[torch.Tensor], torch.Tensor], chunk: int = CHUNK,
                 labels: str = "tokens"):
        super().__init__()
        self.head = drafter
        self._embed = (embed,)  # not a submodule: the target's embedding is frozen and never saved
        self.chunk, self.labels = chunk, labels

    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, teacher: torch.Tensor,
                attention_mask: torch.Tensor, weights: Sequence[float],
                index: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> TTTOutput:
        return dflash_loss(self.head, self._embed[0], aux, input_ids, loss_mask, teacher, attention_mask, weights,
                           reduction="sum", index=index, chunk=self.chunk, labels=self.labels)
