"""The CUDA fast path against the CPU-proven path, on tiny float32 targets on the GPU.

CUDA-graph replay of the target's step (eager kernels, and fused by torch.compile) and of the
EAGLE-3 drafting chain must give the same greedy tokens as plain ``transformers`` generate.
Skipped without CUDA (the ``gpu`` marker).
"""

from __future__ import annotations

import copy

import pytest
import torch

from outrider.engine import SpecEngine
from outrider.proposers.eagle3 import Eagle3Proposer
from outrider.proposers.ngram import NgramProposer

from test_eagle3_proposer import _head

pytestmark = pytest.mark.gpu
MAX_NEW = 24


def _prompts():
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(5, 90, (4,), generator=g).tolist()
    return [torch.randint(5, 90, (n,), generator=g).tolist() + motif * 2 for n in (3, 9, 17)]


@pytest.fixture(scope="module")
def cuda_models(tiny_models):
    cache = {}

    def get(kind):
        if kind not in cache:
            model = copy.deepcopy(tiny_models(kind)).to("cuda")  # the CPU tests keep their own copy
            refs = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_NEW, do_sample=False,
                                   pad_token_id=0)[0, len(p):].tolist() for p in _prompts()]
            cache[kind] = model, refs
        return cache[kind]

    return get


@pytest.mark.parametrize("method", ["ar", "ngram", "eagle3"])
@pytest.mark.parametrize("compile", [False, True])
def test_graphs_equal_transformers(tiny_kind, cuda_models, method, compile):
    model, refs = cuda_models(tiny_kind)
    proposer = {"ar": None, "ngram": NgramProposer(1, 3),
                "eagle3": Eagle3Proposer(_head(model).cuda(), model) if method == "eagle3" else None}[method]
    engine = SpecEngine(model, proposer, k=3, graphs=True, compile=compile)
    prompts = _prompts()
    for _ in range(2):  # the second round replays graphs captured in the first
        got = engine.generate(prompts[:1], MAX_NEW).tokens + engine.generate(prompts[1:], MAX_NEW).tokens
        assert got == refs
