"""Training-time test (TTT): the EAGLE-3 loss, unrolling the head over its own outputs.

Contract. Notation: a sequence ``x_0..x_{S-1}``; ``a_t`` the target's aux features at position
``t`` (computed from ``x_0..x_t``); ``teacher[t]`` the target's logits at ``t`` restricted to the
draft vocabulary, i.e. its prediction of ``x_{t+1}``; ``loss_mask[t] = 1`` iff ``x_t`` is a token
to learn (``outrider.train.data``).

- Step 0, at every position ``t`` at once: the head gets ``h = fc(a_t)`` and the token
  ``x_{t+1}`` and predicts ``x_{t+2}``: it is trained against ``teacher[t+1]``. This is what it
  does at inference: the target has just produced ``x_{t+1}`` from the features up to ``t``.
- Step ``i > 0``: the hidden input is the head's own ``hidden_out`` of step ``i-1`` at the same
  position, the token input is the real ``x_{t+1+i}`` (tokens follow the sequence, as in EAGLE-3's
  TTT), the target is ``teacher[t+1+i]`` (the prediction of ``x_{t+2+i}``). The rotary position
  of step ``i`` is ``pos_t + i``, where the draft token sits at inference.
  A parallel-drafting head (P-EAGLE, arXiv 2602.01469) gets instead, at every step ``i > 0``,
  the placeholder token ``mask_token_id`` and the hidden ``fc(mask_hidden)``, as vLLM feeds its
  placeholder positions; attention, positions and targets are unchanged, so step ``i`` learns
  to predict ``x_{t+2+i}`` from the real context up to ``t`` and the placeholders before it.
- Attention at step ``i``, position ``t``: the step-0 keys at real positions ``s <= t`` (the
  real context, as the draft cache holds it) and the keys of steps ``1..i`` at the same
  position ``t`` only (its own earlier drafts). Implemented by concatenating the per-step keys
  and values ([step-0 | step-1 | ... | step-i], each ``S`` long) with one block mask
  ``[batch, 1, S, (i+1)*S]``: a causal block over the real context and ``i`` diagonal blocks.
  With ``attention="flex"`` the same attention runs in ``flex_attention`` over a ``BlockMask``
  whose ``mask_mod`` is ``kv < S ? kv <= q : kv % S == q``: only the blocks that hold a causal or
  diagonal entry are computed (~S^2/2 + i*S*128 products at step i instead of (i+1)*S^2), GQA
  without expanding the keys. It needs right padding (each row's real tokens first, as the
  trainer's batches are): a real query then never reaches a padding key, and padding queries
  count nowhere. A head with a sliding window ``W`` sees, as at inference, only keys within ``W``
  positions of the query's own (``pos_t + i``): step-0 keys ``s`` with ``t + i - s < W`` and its
  drafts ``j`` with ``i - j < W`` (one mask per step). The softmax scale is the head's (MLA:
  ``outrider.heads.mla``); MLA keys and values arrive expanded per head, values narrower than keys.
- Loss: soft cross-entropy ``-sum_v p(v) log q(v)`` with ``p = softmax(teacher row)``, i.e. the
  target distribution restricted to the draft vocabulary and renormalised, and ``q`` the head's
  draft distribution. Position ``t`` counts at step ``i`` iff ``x_t`` is real and the predicted
  token ``x_{t+2+i}`` exists and is loss-masked (so the teacher's last row, which predicts past
  the sequence, is never a target). Step losses are means over their positions (or sums, with
  ``reduction="sum"``, for callers that normalise across ranks), weighted ``decay**i``.
  Head logits are computed only at counted positions; full-vocabulary logits never appear.
- Metrics: ``per_step_acc[i]`` = fraction of counted positions where the head's argmax equals
  the teacher's argmax over the draft vocabulary; ``sim_accept_len = 1 + sum_k prod_{j<=k}
  acc_j``, the expected tokens per target forward of a chain of ``steps`` drafts **including the
  bonus token** (comparable with bench's ``tau``). A step with no counted position has accuracy 0.
  ``walked_accept_len`` decodes the batch's spans round by round instead, from per-position
  agreement (``agree_map=True``), without the independence and the all-positions averaging of
  ``sim_accept_len``, which overestimates. On text the target itself produced greedily
  (regenerated data) it is the engine's acceptance length on that text, up to tokens outside the
  draft vocabulary (agreement is scored over the draft vocabulary only); on other text it is
  an estimate like the simulated one.

``TTTModule`` wraps the same computation as a module whose single ``forward`` a distributed
wrapper can own (calling ``head.forward_hidden`` on a DDP-wrapped head would skip DDP's hooks).

Not done here: the target forward (``outrider.train.states.capture``), optimisation
(``outrider.train.loop.trainer``), tree-shaped unrolling.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
from torch.nn import functional as F

from outrider.heads.eagle3 import Eagle3Head
from outrider.train.loop import soft_ce
from outrider.train.states.capture import context_mask, real_positions


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, differentiable w.r.t. the head's parameters
    per_step_loss: torch.Tensor  # [steps] mean soft cross-entropy per step (detached; device)
    per_step_acc: torch.Tensor  # [steps] argmax agreement with the teacher per step (device)
    sim_accept_len: torch.Tensor  # scalar: 1 + sum_k prod_{j<=k} acc_j (bonus token included; device)
    n_tokens: int  # positions counted at step 0
    per_step_tokens: torch.Tensor  # [steps] int64 positions counted per step (host)
    per_step_correct: torch.Tensor  # [steps] int64 argmax agreements per step (device)
    agree: torch.Tensor | None = None  # [steps, batch, S] bool: step i at position t agreed (``agree_map``)


class StepKV:
    """Keys/values of the unrolled steps, concatenated along the sequence (autograd-friendly).

    Offers the ``update(k, v, layer_idx)`` the head calls on a cache: it appends this step's
    keys/values and returns all steps' so far, ``[batch, kv_heads, (i+1)*S, head_dim]`` (values
    ``v_head_dim`` wide).
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.append(k)
        self.values.append(v)
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)


def ttt_block_mask(real: torch.Tensor, steps: int) -> torch.Tensor:
    """Boolean mask ``[batch, 1, S, steps*S]`` (True = may attend) for the last step.

    real: [batch, S] bool, False on padding. Step ``i`` uses the first ``(i+1)*S`` columns.
    Block 0 is causal over real keys; blocks 1.. are diagonal. A query always sees its own
    step-0 key, so no row is empty.
    """
    B, S = real.shape
    eye = torch.eye(S, dtype=torch.bool, device=real.device)
    return torch.cat([context_mask(real)] + [eye.expand(B, 1, S, S)] * (steps - 1), dim=-1)


def ttt_step_mask(real: torch.Tensor, step: int, window: int) -> torch.Tensor:
    """``ttt_block_mask``'s first ``(step+1)*S`` columns for a head with a sliding ``window`` > 0:
    [batch, 1, S, (step+1)*S]. The query at t (position ``pos_t + step``) sees step-0 keys s with
    ``t + step - s < window`` and its own drafts j with ``step - j < window``."""
    B, S = real.shape
    ar = torch.arange(S, device=real.device)
    near = (ar[:, None] + step - ar[None, :]) < window  # [S, S]: real tokens are contiguous, so index = position
    eye = torch.eye(S, dtype=torch.bool, device=real.device)
    blocks = [context_mask(real) & near]  # no row is empty: a query always sees its own current-step key
    blocks += [(eye if step - j < window else torch.zeros_like(eye)).expand(B, 1, S, S) for j in range(1, step + 1)]
    return torch.cat(blocks, dim=-1)


ATTENTIONS = ("dense", "flex")


def _flex_mask_mod(S: torch.Tensor, step: torch.Tensor | None = None, window: torch.Tensor | None = None) -> Callable:
    """``mask_mod`` of the TTT attention for sequences of ``S`` (a 0-d tensor: one compiled kernel
    serves every length) over the keys ``[step-0 | step-1 | ...]``, each ``S`` long; with a
    ``window`` (0-d tensors ``step`` and ``window``), ``ttt_step_mask``'s."""
    if window is None:
        def mask_mod(b, h, q, kv):
            return torch.where(kv < S, kv <= q, kv % S == q)
        return mask_mod

    def windowed(b, h, q, kv):
        block = kv // S  # which step's keys
        own = torch.where(kv < S, (kv <= q) & (q + step - kv < window), kv % S == q)
        return own & (step - block < window)
    return windowed


@functools.lru_cache(maxsize=256)
def flex_block_masks(S: int, steps: int, device: torch.device, window: int = 0) -> tuple:
    """The ``BlockMask`` of each step ``i < steps`` (``S`` queries over ``(i+1)*S`` keys), cached per length."""
    from torch.nn.attention.flex_attention import create_block_mask

    size = torch.tensor(S, device=device)
    if not window:
        mod = _flex_mask_mod(size)
        return tuple(create_block_mask(mod, None, None, S, (i + 1) * S, device=device) for i in range(steps))
    w = torch.tensor(window, device=device)
    return tuple(create_block_mask(_flex_mask_mod(size, torch.tensor(i, device=device), w), None, None, S,
                                   (i + 1) * S, device=device) for i in range(steps))


@functools.cache
def _flex_attention(device_type: str) -> Callable:
    """``flex_attention``, compiled on CUDA, dynamic in its sizes from the start (a handful of graphs
    for every batch shape instead of one per length, far from the recompilation limit past which
    dynamo would fall back to the eager one, which materialises the scores and has no backward
    on the CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention


def step_weights(steps: int, decay: float = 0.8) -> list[float]:
    return [decay ** i for i in range(steps)]


def counted_positions(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None,
                      steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The positions each step's loss counts, as ``(batch_index [N_i], position [N_i])`` pairs.

    loss_mask, attention_mask: [batch, S]. Position ``t`` counts at step ``i`` iff ``x_t`` is real
    and ``x_{t+2+i}`` is real and loss-masked. Computed where the masks live: a trainer computes
    them on the host and moves them with the batch, so that the loss needs no host round trip
    (a ``nonzero`` on the device waits for the device).
    """
    real = torch.ones_like(loss_mask, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    learn = loss_mask.bool() & real  # [B, S]
    S = learn.shape[1]
    out = []
    for i in range(steps):
        shift = 1 + i
        counted = torch.zeros_like(learn)  # [B, S]: position t predicts x_{t+2+i}
        if S > shift + 1:
            counted[:, : S - shift - 1] = learn[:, shift + 1:] & real[:, : S - shift - 1]
        out.append(counted.nonzero(as_tuple=True))
    return out


def ttt_loss(head: Eagle3Head, embed: Callable[[torch.Tensor], torch.Tensor], aux: torch.Tensor,
             input_ids: torch.Tensor, loss_mask: torch.Tensor, teacher: torch.Tensor,
             attention_mask: torch.Tensor | None = None, steps: int = 7, decay: float = 0.8,
             weights: Sequence[float] | None = None, reduction: str = "mean", fused: bool | str = False,
             index: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
             compile_head: bool | str | Callable = False, agree_map: bool = False,
             attention: str = "dense") -> TTTOutput:
    """The TTT loss and metrics of one batch (see the module docstring for the alignment).

    head:           the EAGLE-3 head being trained
    embed:          the target's frozen input embedding (module or function of ids)
    aux:            [batch, S, 3*H_t] target aux features
    input_ids:      [batch, S] target token ids
    loss_mask:      [batch, S] 1 on tokens to learn
    teacher:        [batch, S, draft_vocab] target logits on the draft vocabulary (any float dtype)
    attention_mask: [batch, S] 1 on real tokens (None = all real)
    weights:        per-step loss weights; default ``decay**i``
    reduction:      "mean" (each step averaged over its positions) or "sum"
    fused:          compute the loss in fused kernels: "triton" (``outrider.train.loop.soft_ce``: one pass
                    over the logits; CUDA tensors only, compiled elsewhere), "compile" (``torch.compile``),
                    True (Triton where it can be imported, else compile), False (eager)
    index:          ``counted_positions(loss_mask, attention_mask, steps)`` on the batch's device,
                    if the caller has it (else computed here, one device round trip per step)
    compile_head:   run the step's parts before and after the attention ``torch.compile``d
                    (True = inductor, or a backend), dynamic in batch and length: one graph each
                    for every step and shape; the attention over the growing keys stays eager
    agree_map:      also return ``agree`` [steps, batch, S], for ``walked_accept_len``
    attention:      "dense" (SDPA under the block mask) or "flex" (``flex_attention``, the mask's
                    empty blocks skipped; right-padded batches only; no backward on the CPU)

    Metrics come back on the batch's device (no host round trip); ``per_step_tokens`` on the host.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, not {attention!r}")
    B, S = input_ids.shape
    if aux.shape[:2] != (B, S) or teacher.shape != (B, S, head.config.draft_vocab_size):
        raise ValueError(f"shapes disagree: input_ids {tuple(input_ids.shape)}, aux {tuple(aux.shape)}, "
                         f"teacher {tuple(teacher.shape)} (draft vocab {head.config.draft_vocab_size})")
    w = list(weights) if weights is not None else step_weights(steps, decay)
    if len(w) != steps:
        raise ValueError(f"{len(w)} step weights for {steps} steps")
    device = input_ids.device
    loss_fn = loss_function(fused, device.type)
    before, after = _step_parts(head, compile_head)
    real = torch.ones(B, S, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
    if index is None:
        index = counted_positions(loss_mask, real, steps)
    if len(index) != steps:
        raise ValueError(f"{len(index)} position sets for {steps} steps")
    positions = real_positions(real)  # [B, S]

    # a bf16 target may feed a float32 head: cast, unless autocast runs the head in the target's dtype
    dtype = None if torch.is_autocast_enabled(device.type) else head.fc.weight.dtype
    with torch.no_grad():
        tokens = embed(input_ids).to(dtype)  # [B, S, H]
    window = head.config.sliding_window
    if attention == "flex":
        # right padding: no real token after a padding one (checked on the device, no host wait)
        torch._assert_async((real[:, 1:] <= real[:, :-1]).all())
        block_masks, flex = flex_block_masks(S, steps, device, window), _flex_attention(device.type)
        mask = None
    else:
        mask = None if window else ttt_block_mask(real, steps)  # [B, 1, S, steps*S]
    kv = StepKV()
    hidden = head.fuse(aux.to(dtype))  # [B, S, H]
    flat_teacher = teacher.reshape(B * S, -1)  # [B*S, draft_vocab]
    total = hidden.new_zeros(())
    losses, counts, correct = [], [], []
    flags = torch.zeros(steps, B, S, dtype=torch.bool, device=device) if agree_map else None
    parallel = head.config.parallel_drafting
    if parallel:  # P-EAGLE: steps after the first see placeholders, not the tokens and states before them
        with torch.no_grad():
            mask_ids, _ = head.placeholder(B, S)
            mask_tokens = embed(mask_ids).to(dtype)  # [B, S, H]
    for i in range(steps):
        shift = 1 + i
        if parallel and i > 0:
            token_in = mask_tokens
            hidden = head.placeholder(B, S)[1].to(hidden.dtype)  # [B, S, H] fc(mask_hidden), with its gradient
        else:
            token_in = torch.zeros_like(tokens)  # token x_{t+1+i} at position t; zeros past the end
            token_in[:, : max(S - shift, 0)] = tokens[:, shift:]
        q, k, v = before(token_in, hidden, positions + i)  # = head.forward_hidden, in three parts
        if attention == "flex":
            keys, values = kv.update(k, v)  # [B, kv_heads, (i+1)*S, d], [B, kv_heads, (i+1)*S, d_v]
            out = flex(q, keys, values, block_mask=block_masks[i], enable_gqa=True,
                       scale=head.attention_scale)  # [B, heads, S, d_v]
            attended = out.transpose(1, 2).reshape(B, S, -1)  # [B, S, heads * d_v]
        else:
            step_mask = ttt_step_mask(real, i, window) if window else mask[..., : (i + 1) * S]
            attended = head.attend(q, k, v, step_mask, kv)
        hidden = after(hidden, attended)
        b, t = index[i]  # [N_i] each
        ce, agree = loss_fn(head.compute_logits(hidden[b, t]), flat_teacher, b * S + t + shift)  # [N_i], [N_i]
        n = int(b.numel())
        step_loss = ce.sum() / max(n, 1) if reduction == "mean" else ce.sum()
        total = total + w[i] * step_loss
        losses.append(ce.detach().sum() / max(n, 1))
        counts.append(n)
        correct.append(agree.sum())
        if agree_map:
            flags[i, b, t] = agree

    per_step_correct = torch.stack(correct)  # [steps] on the device
    acc = torch.stack([c.double() / max(n, 1) for c, n in zip(correct, counts)])  # [steps]
    return TTTOutput(
        loss=total,
        per_step_loss=torch.stack(losses).float(),
        per_step_acc=acc.float(),
        sim_accept_len=simulated_accept_len(acc),
        n_tokens=counts[0],
        per_step_tokens=torch.tensor(counts, dtype=torch.long),
        per_step_correct=per_step_correct,
        agree=flags,
    )


def soft_cross_entropy(logits: torch.Tensor, teacher: torch.Tensor,
                       rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``-sum_v p(v) log q(v)`` per row, ``p = softmax(teacher row)``, ``q = softmax(logits)``, in float32,
    and whether the argmaxes agree. logits: [N, V]; teacher: [N, V], or [M, V] with ``rows`` [N]
    picking the teacher row of each logits row -> ([N] float32, [N] bool)."""
    if rows is not None:
        teacher = teacher.index_select(0, rows)  # [N, V]; fused into the loss's loads when compiled
    logq = F.log_softmax(logits.float(), dim=-1)  # [N, V]
    ce = -(F.softmax(teacher.float(), dim=-1) * logq).sum(-1)  # [N]
    return ce, logq.detach().argmax(-1) == teacher.argmax(-1)


_COMPILED_PARTS: "weakref.WeakKeyDictionary[Eagle3Head, dict]" = weakref.WeakKeyDictionary()


def _step_parts(head: Eagle3Head, compile_head: bool | str | Callable) -> tuple[Callable, Callable]:
    """The head's ``before_attention`` and ``after_attention``, compiled once per head and backend."""
    if not compile_head:
        return head.before_attention, head.after_attention
    backend = "inductor" if compile_head is True else compile_head
    per_head = _COMPILED_PARTS.setdefault(head, {})
    if backend not in per_head:
        per_head[backend] = (torch.compile(head.before_attention, backend=backend, dynamic=True),
                             torch.compile(head.after_attention, backend=backend, dynamic=True))
    return per_head[backend]


def loss_function(fused: bool | str, device_type: str = "cuda") -> Callable:
    """The soft cross-entropy ``ttt_loss`` uses for its ``fused`` setting (see there) on tensors of
    ``device_type``; the Triton kernels serve CUDA tensors only (elsewhere a fused loss is compiled)."""
    if fused not in (False, True, "triton", "compile"):
        raise ValueError(f"fused must be a bool, 'triton' or 'compile', not {fused!r}")
    if not fused:
        return soft_cross_entropy
    if device_type != "cuda":
        return fused_soft_cross_entropy()
    if fused == "triton" or (fused is True and soft_ce.available()):
        if not soft_ce.available():
            raise RuntimeError("the Triton loss needs the triton package (or use the 'compile' loss kernel)")
        return soft_ce.soft_cross_entropy_triton
    return fused_soft_cross_entropy()


@functools.cache
def fused_soft_cross_entropy():
    """``soft_cross_entropy`` compiled by ``torch.compile`` (once per process, dynamic row count):
    the teacher's row gather, the softmaxes, the product and the reductions fuse into a few passes
    over the logits, in the forward and the backward, instead of one materialised tensor per operation."""
    return torch.compile(soft_cross_entropy, dynamic=True)


class TTTModule(torch.nn.Module):
    """``ttt_loss`` as one module forward, so that DDP/FSDP can wrap it (one forward per backward).

    Holds the head as its only submodule (``.head``); the target's embedding is kept unregistered,
    so the module's parameters and state dict are the head's alone.
    """

    def __init__(self, head: Eagle3Head, embed: Callable[[torch.Tensor], torch.Tensor], steps: int = 7,
                 decay: float = 0.8, weights: Sequence[float] | None = None, reduction: str = "mean",
                 fused: bool | str = False, compile_head: bool | str | Callable = False, attention: str = "dense"):
        super().__init__()
        self.head = head
        self._embed = (embed,)
        self.steps, self.decay, self.weights, self.reduction, self.fused = steps, decay, weights, reduction, fused
        self.compile_head, self.attention = compile_head, attention

    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, teacher: torch.Tensor,
                attention_mask: torch.Tensor | None = None, weights: Sequence[float] | None = None,
                index: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> TTTOutput:
        # ``weights`` and ``index`` of this call (a trainer normalises each step by its global counts)
        # take the place of the module's
        return ttt_loss(self.head, self._embed[0], aux, input_ids, loss_mask, teacher, attention_mask,
                        steps=self.steps, decay=self.decay, weights=self.weights if weights is None else list(weights),
                        reduction=self.reduction, fused=self.fused, index=index, compile_head=self.compile_head,
                        attention=self.attention)


class Walk(NamedTuple):
    tokens: int  # tokens gained, a bonus (or corrected) token per round included
    rounds: int  # rounds (target forwards)
    first: int  # rounds whose first draft was accepted


def walked_accept_len(agree: torch.Tensor, loss_mask: torch.Tensor, real: torch.Tensor | None = None,
                      k: int | None = None) -> Walk:
    """Decode every loss-masked span greedily, as the engine would with chains of ``k`` drafts:
    tokens / rounds is the acceptance length (bonus token included).

    agree: [steps, batch, S] (``ttt_loss(..., agree_map=True)``); loss_mask, real: [batch, S].
    A span ``x_a..x_{b-1}`` opens with ``x_a`` from the target; a round that has ``x_0..x_{L-1}``
    drafts with the head at position ``t = L-2``: draft ``j`` is step ``j`` at ``t`` (token inputs
    teacher-forced, which is what the engine feeds once the drafts before it were accepted), and
    the round accepts the leading run of agreeing steps, then the target adds one token (counted
    even when the span ends there, as the engine's tau counts a round's outcome before stopping
    at EOS or at the token limit). Unlike
    ``simulated_accept_len``, which multiplies accuracies averaged over every position, it counts
    only the positions where rounds really start (those after a rejected draft are harder) and
    keeps the steps' dependence on each other.
    """
    steps = agree.shape[0]
    k = steps if k is None else min(k, steps)
    ok = agree[:k].to("cpu").numpy()  # [k, batch, S]
    learn = loss_mask.bool() if real is None else loss_mask.bool() & real.bool()
    learn = learn.to("cpu").numpy()
    tokens = rounds = first = 0
    for row in range(learn.shape[0]):
        S = learn.shape[1]
        a = 0
        while a < S:
            if not learn[row, a]:
                a += 1
                continue
            b = a
            while b < S and learn[row, b]:
                b += 1
            L = a + 1  # x_a came from the target's own step
            while L < b:
                t, n = L - 2, 0
                while n < k and t >= 0 and ok[n, row, t]:
                    n += 1
                tokens += n + 1
                rounds += 1
                first += n > 0
                L += n + 1
            a = b
    return Walk(tokens, rounds, first)


def simulated_accept_len(acc: torch.Tensor) -> torch.Tensor:
    """``1 + sum_k prod_{j<=k} acc_j`` for per-step accuracies ``acc`` [steps] (bonus token included)."""
    return (1.0 + torch.cumprod(acc.double(), dim=0).sum()).float()
