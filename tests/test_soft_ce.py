"""The Triton soft cross-entropy against the eager one, on the CPU through Triton's interpreter.

Runs in a subprocess with ``TRITON_INTERPRET=1`` (the variable must be set before the kernels are
defined). Skipped where triton is not installed; on a GPU, ``test_gpu.py`` checks the compiled kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from outrider.train.loop import soft_ce

SCRIPT = r"""
import json, torch
from outrider.train.loop.soft_ce import soft_cross_entropy_triton
from outrider.train.loop.ttt import soft_cross_entropy
torch.manual_seed(0)
N, M, V = 9, 13, 5000  # three blocks of 2048, the last partly past V
x = 3 * torch.randn(N, V)
t = 4 * torch.randn(M, V)
rows = torch.randint(0, M, (N,))
rows[:4] = torch.tensor([3, 5, 7, 3])
t[3, 100] = t[3, 4500] = 60.0  # a tie across blocks: the first index wins
x[0, 100] = 50.0  # agrees with teacher row 3
x[3, 4500] = 50.0  # the later of the tied indices: disagrees
t[5, 4999] = 60.0
x[1, 4999] = 50.0  # the last column, in the partial block: agrees
x[2, 17] = x[2, 4097] = 40.0  # a tie in the logits; teacher row 7 peaks at 4097: disagrees
t[7, 4097] = 60.0
out = {}
for name, fn in (("triton", soft_cross_entropy_triton), ("eager", soft_cross_entropy)):
    logits = x.clone().requires_grad_(True)
    ce, agree = fn(logits, t, rows)
    (grad,) = torch.autograd.grad((ce * torch.linspace(0.5, 2.0, N)).sum(), logits)
    out[name] = (ce, agree, grad)
(ce, agree, grad), (ce_e, agree_e, grad_e) = out["triton"], out["eager"]
empty, _ = soft_cross_entropy_triton(torch.zeros(0, V, requires_grad=True), t, torch.zeros(0, dtype=torch.long))
print(json.dumps({"ce_err": (ce - ce_e).abs().max().item(), "ce_scale": ce_e.abs().max().item(),
                  "grad_err": (grad - grad_e).abs().max().item(), "agree": agree.tolist(),
                  "agree_eager": agree_e.tolist(), "dtype": str(ce.dtype), "empty": list(empty.shape)}))
"""


@pytest.mark.skipif(not soft_ce.available(), reason="triton is not installed")
def test_triton_soft_cross_entropy_matches_eager_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["ce_err"] <= 1e-5 * got["ce_scale"]
    assert got["grad_err"] < 1e-6
    assert got["agree"] == got["agree_eager"]
    assert got["agree"][:4] == [True, True, False, False]
    assert got["dtype"] == "torch.float32" and got["empty"] == [0]


def test_loss_function_choices():
    from outrider.train.loop.ttt import (
        fused_soft_cross_entropy,
        loss_function,
        soft_cross_entropy,
    )

    assert loss_function(False) is soft_cross_entropy
    assert loss_function("compile") is fused_soft_cross_entropy()
    assert loss_function(True) is (soft_ce.soft_cross_entropy_triton if soft_ce.available()
                                   else fused_soft_cross_entropy())
    assert loss_function("triton", "cpu") is fused_soft_cross_entropy()  # the kernels serve CUDA tensors
    with pytest.raises(ValueError):
        loss_function("cuda")
