"""SpecEngine: greedy speculative output equals plain greedy `transformers` generate, token for token."""

from __future__ import annotations

import pytest
import torch

from outrider.decode.engine import SpecEngine
from outrider.decode.proposers.draft_model import DraftModelProposer
from outrider.decode.proposers.eagle3 import Eagle3Proposer
from outrider.decode.proposers.ngram import NgramProposer
from outrider.decode.sampling import SamplingParams
from outrider.errors import UserError

MAX_NEW = 24


def _prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    # a repeated motif gives n-gram lookup something to find
    motif = torch.randint(5, 90, (4,), generator=g).tolist()
    return [torch.randint(5, 90, (n,), generator=g).tolist() + motif * 2 for n in (3, 9, 17)]


def _hf_greedy(model, prompt, max_new, eos=None):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def refs(tiny_models):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = [_hf_greedy(tiny_models(kind), p, MAX_NEW) for p in _prompts()]
        return cache[kind]

    return get


@pytest.mark.parametrize("method", ["ar", "ngram", "draft_self", "draft_other"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_transformers(tiny_kind, tiny_models, refs, method, batch):
    model = tiny_models(tiny_kind)
    proposer = {"ar": None, "ngram": NgramProposer(1, 3),
                "draft_self": DraftModelProposer(model),
                "draft_other": DraftModelProposer(tiny_models("llama", 7))}[method]
    engine = SpecEngine(model, proposer, k=3)
    prompts, expected = _prompts(), refs(tiny_kind)
    got = []
    for i in range(0, len(prompts), batch):
        got.extend(engine.generate(prompts[i:i + batch], MAX_NEW).tokens)
    assert got == expected


@pytest.mark.parametrize("method", ["ar", "ngram", "eagle3"])
@pytest.mark.parametrize("variant", ["static", "compiled", "padded"])
def test_static_and_compiled_steps_equal_transformers(tiny_kind, tiny_models, refs, method, variant, monkeypatch):
    """The GPU-shaped paths on the CPU: the whole-buffer cache whose mask is built from the
    device-side slot pointer, and the step traced by torch.compile (aot_eager: the same graph
    capture as inductor, without code generation). EAGLE-3 is pipelined there (its next draft
    runs before the host reads the outcome; commits leave unused slots masked). "padded": the
    graph mode's pooled caches and prompts padded to a multiple of 64 positions where their
    forward would be graphed (dense targets; the forwards themselves eager: no CUDA here)."""
    from test_eagle3_proposer import _head

    model = tiny_models(tiny_kind)
    proposer = {"ar": None, "ngram": NgramProposer(1, 3),
                "eagle3": Eagle3Proposer(_head(model), model) if method == "eagle3" else None}[method]
    options = {"read_len": "max"} if variant == "static" else {"compile": "aot_eager"}
    from outrider.ops.graphs import graphable
    from outrider.decode.runner import CachedLM

    widths, forward = [], CachedLM.forward

    def recording(lm, ids, *args, **kwargs):  # the prompts' forwards: their widths
        if kwargs.get("logits_at") is not None:
            widths.append(ids.shape[1])
        return forward(lm, ids, *args, **kwargs)

    monkeypatch.setattr(CachedLM, "forward", recording)
    engine = SpecEngine(model, proposer, k=3, **options)
    engine.graphs = variant == "padded"
    prompts, expected = _prompts(), refs(tiny_kind)
    got = engine.generate(prompts[:1], MAX_NEW).tokens + engine.generate(prompts[1:], MAX_NEW).tokens
    assert got == expected
    padded = variant == "padded" and graphable(model)  # a mixture of experts: no graphed prompt forward, no padding
    assert widths == ([64, 64] if padded else [len(prompts[0]), len(prompts[2])])


def test_compiled_step_is_shared_between_caches(tiny_models):
    """A second cache of the same model and size reuses the compiled step: no new graph."""
    from torch._dynamo.utils import counters

    from outrider.decode.runner import CachedLM

    model = tiny_models("llama")

    def decode():
        lm = CachedLM(model, 1, 96, compile="aot_eager")
        lm.forward(torch.tensor([[5, 6, 7]]), logits_at=torch.tensor([2]))
        lm.commit(torch.ones(1, 3, dtype=torch.bool))
        for n in (1, 2, 3):
            lm.forward(torch.full((1, n), 9))
            lm.commit(torch.ones(1, n, dtype=torch.bool))
        return counters["stats"]["unique_graphs"]

    first = decode()
    assert decode() == first


def test_inductor_step_with_frozen_weights_equals_transformers(tiny_kind, tiny_models, refs):
    """``compile=True`` fuses the step with inductor, weights frozen (the path CUDA graphs capture on
    a GPU): query/key/value and gate/up fold into fewer matrix products, the tokens stay the same."""
    model = tiny_models(tiny_kind)
    engine = SpecEngine(model, None, compile=True, read_len="max")
    assert engine.generate(_prompts(), MAX_NEW).tokens == refs(tiny_kind)


def test_compiled_prefill_equals_the_eager_one(tiny_models):
    """``compile_prefill``: prompts of two lengths (one compilation, dynamic in its sizes), asking
    logits at two positions and then at one, give the eager forward's logits and aux states, and
    the steps after them the same logits."""
    from torch._dynamo.utils import counters

    from outrider.decode.runner import CachedLM

    model = tiny_models("llama")
    graphs = []
    for P in (7, 12):
        ids = torch.randint(3, 90, (2, P), generator=torch.Generator().manual_seed(P))
        valid = torch.ones(2, P, dtype=torch.bool)
        valid[1, P - 3:] = False  # a shorter second prompt
        out = []
        for fused in (False, True):
            lm = CachedLM(model, 2, 64, aux_layer_ids=(0, 1, 3), read_len="max", compile="inductor",
                          compile_prefill=fused)
            before = counters["stats"]["unique_graphs"]
            logits = lm.forward(ids, query_valid=valid, logits_at=torch.tensor([P - 4, P - 1][P > 7:]))
            assert logits.shape[:2] == (2, 2 if P == 7 else 1)
            aux = lm.aux
            if fused and P == 7:
                assert counters["stats"]["unique_graphs"] > before  # the prompt's forward was compiled
            lm.commit(valid)
            out.append((logits, aux[valid], lm.forward(torch.full((2, 2), 9))))
            lm.close()
        for got, want in zip(out[1], out[0]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0]  # the second prompt length, one row of logits: nothing new compiled


_FOLD_SCRIPT = """
import json, re, torch, torch._inductor.config
from torch._inductor.utils import run_and_get_code
from outrider.decode import runner
from outrider.ops.graphs import CompileOptions
from tiny import make_tiny
model = make_tiny("llama")
ids = torch.tensor([[5, 6, 7, 8]])
out = {}
for freeze in (False, True):
    torch._dynamo.reset()
    lm = runner.CachedLM(model, 1, 32, read_len="max", compile=CompileOptions(freeze_weights=freeze))
    lm.forward(ids, query_valid=torch.ones_like(ids, dtype=torch.bool))
    lm.commit(torch.ones_like(ids, dtype=torch.bool))
    _, code = run_and_get_code(lambda: lm.forward(ids[:, :2]))
    code = "\\n".join(code)
    out[str(freeze)] = [len(re.findall(r"extern_kernels\\.mm\\(", code)), "_frozen_param" in code]
print(json.dumps(out))
"""


def test_frozen_weights_fold_the_projections_of_one_input():
    """Frozen weights (``CompileOptions.freeze_weights``) really reach inductor: q/k/v and gate/up of each
    layer fold into one matrix product each (7 -> 4 per layer), seen in the generated code. On the
    CPU inductor folds only when told to and packs weights for oneDNN unless told not to (both set
    here; a GPU folds by default); a fresh interpreter, as inductor registers its freezing passes
    once per process."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    script = "import torch._inductor.config as c; c.cpp.weight_prepack = False; c.cpp.enable_concat_linear = True\n"
    run = subprocess.run([sys.executable, "-c", script + _FOLD_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    layers = 4  # tiny.make_tiny's default
    assert got == {"False": [7 * layers + 1, False], "True": [4 * layers + 1, True]}  # + the lm_head


def test_self_draft_accepts_everything(tiny_models):
    model = tiny_models("llama")
    for k in (1, 4, 6):
        # 1 token from the prefill, then 5 whole steps of k+1: no step is cut by max_new_tokens
        r = SpecEngine(model, DraftModelProposer(model), k=k).generate(_prompts()[:2], 1 + 5 * (k + 1))
        assert r.tau == pytest.approx(k + 1)
        assert r.accept_rate_per_pos == [1.0] * k


def _emitted_per_step(r) -> float:
    """Tokens the verify steps emitted (all but each row's first, which the prefill yields), per row step."""
    return (r.new_tokens - len(r.tokens)) / r.row_steps


@pytest.mark.parametrize("k, max_new", [(100, 8), (6, 40), (4, 3)])
def test_tau_counts_the_tokens_steps_emit_when_max_new_tokens_cuts_them(tiny_models, k, max_new):
    """tau is tokens emitted per verify step: never above k+1, never above what the steps emitted
    (a self-draft accepts all k+1, but max_new_tokens cuts the last step; it once reported 21.0
    for 8 tokens at k=100)."""
    model = tiny_models("llama")
    for proposer in (DraftModelProposer(model), NgramProposer(1, 3)):
        r = SpecEngine(model, proposer, k=k).generate(_prompts()[:2], max_new)
        assert all(len(t) <= max_new for t in r.tokens)
        assert 1.0 <= r.tau <= k + 1
        assert r.tau == pytest.approx(_emitted_per_step(r))  # no EOS in these tiny runs: exactly the emitted
        assert all(0.0 <= a <= 1.0 for a in r.accept_rate_per_pos)
    r = SpecEngine(model, DraftModelProposer(model), k=k).generate(_prompts()[:2], max_new)
    assert r.accept_rate_per_pos[:max_new - 2] == [1.0] * min(k, max_new - 2)  # a cut step still accepted all


def test_ngram_tau_above_one_on_repetitive_text(tiny_models):
    model = tiny_models("llama")
    r = SpecEngine(model, NgramProposer(1, 3), k=4).generate(_prompts(), MAX_NEW)
    assert r.tau > 1.0
    assert len(r.accept_rate_per_pos) == 4


def test_eos_stops_each_row(tiny_models):
    model = tiny_models("llama")
    prompts = _prompts()
    plain = SpecEngine(model, None).generate(prompts, MAX_NEW).tokens
    # declare the 5th generated token of row 0 an EOS: row 0 must stop right there, inclusive
    eos = plain[0][4]
    for proposer in (None, NgramProposer(), DraftModelProposer(model)):
        r = SpecEngine(model, proposer, k=3, eos_ids=[eos]).generate(prompts, MAX_NEW)
        for got, full in zip(r.tokens, plain):
            cut = full.index(eos) + 1 if eos in full else len(full)
            assert got == full[:cut]
        assert r.tokens[0][-1] == eos and len(r.tokens[0]) <= 5


def test_eos_matches_transformers(tiny_models):
    model = tiny_models("deepseek_v3")
    prompt = _prompts()[1]
    plain = _hf_greedy(model, prompt, MAX_NEW)
    eos = plain[6]
    expected = _hf_greedy(model, prompt, MAX_NEW, eos=eos)
    got = SpecEngine(model, DraftModelProposer(model), k=4, eos_ids=[eos]).generate([prompt], MAX_NEW).tokens[0]
    assert got == expected


def test_sampling_is_deterministic_under_seed(tiny_models):
    model = tiny_models("llama")
    prompts = _prompts()

    def run(seed, proposer):
        s = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=seed)
        return SpecEngine(model, proposer, k=3, sampling=s).generate(prompts, 24).tokens

    a = run(3, DraftModelProposer(tiny_models("llama", 7)))
    b = run(3, DraftModelProposer(tiny_models("llama", 7)))
    c = run(4, DraftModelProposer(tiny_models("llama", 7)))
    assert a == b
    assert a != c


def test_sampled_tokens_follow_target_distribution(tiny_models):
    """Speculative sampling and plain sampling give the same token distribution (two-sample TV)."""
    model = tiny_models("llama")
    rows = 1500
    prompt = _prompts()[1]
    s = SamplingParams(temperature=1.0, seed=11)
    # position 3 of the output is produced by verification (position 0 comes from prefill)
    plain = SpecEngine(model, None, sampling=s).generate([prompt] * rows, 4).tokens
    spec = SpecEngine(model, DraftModelProposer(tiny_models("llama", 7)), k=3,
                      sampling=SamplingParams(temperature=1.0, seed=90_000)).generate([prompt] * rows, 4).tokens
    V = model.config.vocab_size

    def hist(outs, pos):
        return torch.bincount(torch.tensor([o[pos] for o in outs]), minlength=V).float() / len(outs)

    for pos in (1, 3):
        tv_same = 0.5 * (hist(plain, pos) - hist(spec, pos)).abs().sum().item()
        # reference: the same statistic against the draft model's own samples
        draft_only = SpecEngine(tiny_models("llama", 7), None, sampling=s).generate([prompt] * rows, 4).tokens
        tv_other = 0.5 * (hist(plain, pos) - hist(draft_only, pos)).abs().sum().item()
        assert tv_same < 0.12, tv_same
        assert tv_same < tv_other / 3, (tv_same, tv_other)


@pytest.mark.parametrize("bad", [[], [[]], [[1, 2, 10_000]]])
def test_bad_prompts_are_user_errors(tiny_models, bad):
    with pytest.raises(UserError):
        SpecEngine(tiny_models("llama"), None).generate(bad, 4)


def test_k_must_be_positive(tiny_models):
    with pytest.raises(UserError):
        SpecEngine(tiny_models("llama"), NgramProposer(), k=0)


def test_static_shapes_compile_every_width_and_keep_the_logits(tiny_models):
    """``CompileOptions.static_shapes`` (the default): the compiled step specialises on each width
    (1, 3, 4: three compilations, where dynamic shapes turn dynamic at the second width and serve
    the third), and its logits equal the eager step's."""
    from torch._dynamo.utils import counters

    from outrider.ops.graphs import CompileOptions
    from outrider.decode.runner import CachedLM

    model = tiny_models("llama")
    ids = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(3))
    compiled_graphs = {}
    try:
        for static in (False, True):
            torch._dynamo.reset()
            options = CompileOptions(static_shapes=static)
            lms = [CachedLM(model, 1, 64, read_len="max", compile=c) for c in (False, options)]
            for lm in lms:
                lm.forward(ids[:, :5], query_valid=torch.ones(1, 5, dtype=torch.bool))
                lm.commit(torch.ones(1, 5, dtype=torch.bool))
            before = counters["stats"]["unique_graphs"]
            start = 5
            for n in (1, 3, 4):
                step = ids[:, start:start + n].clone()  # a slice's storage offset would be guarded on
                want, got = (lm.forward(step) for lm in lms)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                for lm in lms:
                    lm.commit(torch.ones(1, n, dtype=torch.bool))
                start += n
            compiled_graphs[static] = counters["stats"]["unique_graphs"] - before
    finally:  # later tests compile afresh
        torch._dynamo.reset()
    assert compiled_graphs == {False: 2, True: 3}


def test_pooled_target_caches_are_bounded_least_recently_used_first(tiny_models, monkeypatch):
    """Graph or compile mode keeps a target cache per batch size for reuse: at most POOLED_SHAPES,
    the least recently used closed (and the device rounds built on it dropped), so that a run
    through many batch sizes (regeneration's last batch of each chunk) does not fill the GPU."""
    from types import SimpleNamespace

    import outrider.decode.engine as engine_module

    made, closed = [], []

    class Cache:
        def __init__(self, model, batch, max_len, **kw):
            self.batch, self.cache = batch, type("C", (), {"max_len": max_len})()
            made.append(batch)

        def reset(self):
            pass

        def close(self):
            closed.append(self.batch)

    monkeypatch.setattr(engine_module, "CachedLM", Cache)
    monkeypatch.setattr(engine_module, "POOLED_SHAPES", 2)
    engine = SpecEngine(tiny_models("llama"), None, compile=True)
    first = engine._target_lm(1, 100, None)
    assert engine._target_lm(1, 50, None) is first and made == [1]  # reused: it is long enough
    second = engine._target_lm(2, 100, None)
    engine.rounds_pool[(1, 3)] = SimpleNamespace(target=first)  # device rounds hold the cache they run on
    engine.rounds_pool[(2, 3)] = SimpleNamespace(target=second)
    engine._target_lm(1, 100, None)  # batch 1 used last: batch 2 is now the oldest
    engine._target_lm(3, 100, None)
    assert closed == [2] and sorted(b for b, _ in engine._pool) == [1, 3] and list(engine.rounds_pool) == [(1, 3)]
    engine._target_lm(1, 2000, None)  # too short for this prompt: replaced, not kept beside the new one
    assert closed == [2, 1] and made == [1, 2, 3, 1] and len(engine._pool) == 2 and not engine.rounds_pool


def test_the_collector_is_held_off_while_a_graph_is_captured_and_restored_after():
    """A collection inside a capture could free an earlier engine's dead graph, whose reset
    invalidates the capture: ``capture_graph`` captures inside ``collector_off``."""
    import gc

    from outrider.ops.graphs import collector_off

    assert gc.isenabled()
    with collector_off():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_off():
        raise RuntimeError("a capture that fails")
    assert gc.isenabled()  # restored after a failure too
    gc.disable()
    try:
        with collector_off():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a collector off before stays off
    finally:
        gc.enable()
