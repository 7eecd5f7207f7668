"""The TTT loss's soft cross-entropy in one pass over the logits: Triton kernels, forward and backward.

Contract. ``soft_cross_entropy_triton(logits, teacher, rows)`` returns what
``outrider.train.loop.ttt.soft_cross_entropy`` returns, computed by two Triton kernels:

- logits [N, V] (bf16, fp16 or fp32), teacher [M, V] (any float dtype), rows [N] int64: row ``i``
  of the logits is scored against teacher row ``rows[i]`` (the gather happens in the kernel's
  loads; no [N, V] copy of the teacher exists);
- returns ``ce`` [N] float32, ``ce_i = -sum_v p_v log q_v`` with ``p = softmax(teacher[rows[i]])``
  and ``q = softmax(logits[i])``, differentiable w.r.t. the logits, and ``agree`` [N] bool, whether
  the two argmaxes agree (the first index among ties, as ``torch.argmax``).

Notation: ``lse_q``, ``lse_p`` the log-normalisers of a row of the logits and of the teacher.
Since ``sum_v p_v = 1``, ``ce = lse_q - sum_v p_v x_v``. The forward kernel streams the row once,
keeping running maxima and rescaled sums (online softmax) of both rows and of ``sum exp(t) x``; it
saves ``lse_q`` and ``lse_p`` ([N] float32 each). The backward kernel writes
``d ce / d x_v = g (exp(x_v - lse_q) - exp(t_v - lse_p))`` in one more pass. One program per row;
no atomics, so results are deterministic. Accumulation is in float32.

Runs wherever Triton runs: CUDA, or the CPU under ``TRITON_INTERPRET=1`` (the tests' way to check
the kernels without a GPU). ``available()`` says whether Triton can be imported; callers fall
back to the ``torch.compile``d loss when it cannot.

Not done here: fusing the head's ``lm_head`` matmul into the loss (the logits still exist),
ignore-index rows, label smoothing.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def forward(logits, teacher, rows, ce, agree, lse_q, lse_p, V, stride_x, stride_t, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        src = tl.load(rows + r)
        x_row = logits + r * stride_x
        t_row = teacher + src * stride_t
        m_q = float("-inf")
        s_q = 0.0
        m_p = float("-inf")
        s_p = 0.0
        w = 0.0  # sum exp(t - m_p) * x
        arg_q = 0
        arg_p = 0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            x = tl.load(x_row + offs, mask=ok, other=float("-inf")).to(tl.float32)
            t = tl.load(t_row + offs, mask=ok, other=float("-inf")).to(tl.float32)
            bx = tl.max(x, axis=0)
            bt = tl.max(t, axis=0)
            ix = tl.argmax(x, axis=0)
            it = tl.argmax(t, axis=0)
            arg_q = tl.where(bx > m_q, start + ix, arg_q)  # strict: an earlier block keeps a tie
            arg_p = tl.where(bt > m_p, start + it, arg_p)
            new_q = tl.maximum(m_q, bx)
            new_p = tl.maximum(m_p, bt)
            s_q = s_q * tl.exp(m_q - new_q) + tl.sum(tl.exp(x - new_q), axis=0)
            e_t = tl.exp(t - new_p)
            scale = tl.exp(m_p - new_p)
            s_p = s_p * scale + tl.sum(e_t, axis=0)
            w = w * scale + tl.sum(e_t * tl.where(ok, x, 0.0), axis=0)  # e_t = 0 past V
            m_q = new_q
            m_p = new_p
        lq = m_q + tl.log(s_q)
        tl.store(ce + r, lq - w / s_p)
        tl.store(agree + r, (arg_q == arg_p).to(tl.int8))
        tl.store(lse_q + r, lq)
        tl.store(lse_p + r, m_p + tl.log(s_p))

    @triton.jit
    def backward(logits, teacher, rows, grad_ce, lse_q, lse_p, grad, V, stride_x, stride_t, stride_g,
                 BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        src = tl.load(rows + r)
        g = tl.load(grad_ce + r)
        lq = tl.load(lse_q + r)
        lp = tl.load(lse_p + r)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            x = tl.load(logits + r * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
            t = tl.load(teacher + src * stride_t + offs, mask=ok, other=0.0).to(tl.float32)
            d = g * (tl.exp(x - lq) - tl.exp(t - lp))
            tl.store(grad + r * stride_g + offs, d.to(grad.dtype.element_ty), mask=ok)

    return forward, backward


_BLOCK = 2048  # the fastest of (1024..8192, 4..16 warps) on an H200 at [16000, 32000] bf16 (soft_ce_bench.py)
_WARPS = 4


class _SoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, teacher: torch.Tensor, rows: torch.Tensor):
        # logits: [N, V]; teacher: [M, V]; rows: [N] int64 -> ce [N] float32, agree [N] bool
        forward_kernel, _ = _kernels()
        N, V = logits.shape
        ce = torch.empty(N, dtype=torch.float32, device=logits.device)
        agree = torch.empty(N, dtype=torch.int8, device=logits.device)
        lse_q = torch.empty_like(ce)
        lse_p = torch.empty_like(ce)
        if N:
            forward_kernel[(N,)](logits, teacher, rows, ce, agree, lse_q, lse_p, V, logits.stride(0),
                                 teacher.stride(0), BLOCK=_BLOCK, num_warps=_WARPS)
        ctx.save_for_backward(logits, teacher, rows, lse_q, lse_p)
        ctx.mark_non_differentiable(agree)
        return ce, agree.bool()

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, _grad_agree):
        _, backward_kernel = _kernels()
        logits, teacher, rows, lse_q, lse_p = ctx.saved_tensors
        N, V = logits.shape
        grad = torch.empty_like(logits)
        if N:
            backward_kernel[(N,)](logits, teacher, rows, grad_ce.float().contiguous(), lse_q, lse_p, grad, V,
                                  logits.stride(0), teacher.stride(0), grad.stride(0), BLOCK=_BLOCK,
                                  num_warps=_WARPS)
        return grad, None, None


def soft_cross_entropy_triton(logits: torch.Tensor, teacher: torch.Tensor,
                              rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring: ([N] float32 soft cross-entropy, [N] bool argmax agreement)."""
    # logits: [N, V]; teacher: [M, V]; rows: [N] (None: teacher row i for logits row i, M = N)
    if logits.dim() != 2 or teacher.dim() != 2 or logits.shape[1] != teacher.shape[1]:
        raise ValueError(f"logits {tuple(logits.shape)} and teacher {tuple(teacher.shape)} must be [N, V] and [M, V]")
    if rows is None:
        if teacher.shape[0] != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows but {teacher.shape[0]} teacher rows and no row index")
        rows = torch.arange(logits.shape[0], device=logits.device)
    return _SoftCE.apply(logits.contiguous(), teacher.contiguous(), rows.to(torch.int64).contiguous())
