"""DFlash block drafters: the config and its engine fields, lossless decoding (GQA and MLA targets,
batch 1 and 4, device rounds, compiled drafting, sampling), the drafts are exactly what training
computes, one forward per round, the file layout reloads equal, refusals in one line."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import assert_compiled_greedy_is_plain, make_tiny, random_vocab

from outrider.decode.engine import SpecEngine
from outrider.decode.proposers import PROPOSERS
from outrider.decode.proposers.dflash import DFlashProposer
from outrider.decode.sampling import SamplingParams
from outrider.errors import UserError
from outrider.heads.dflash import DFlashConfig, DFlashDrafter
from outrider.interop.checkpoint import load_head
from outrider.interop.formats.dflash import random_check, read_dflash, write_dflash

MAX_NEW = 16
KINDS = ["llama", "deepseek_v3"]


def random_drafter(model, seed=0, block_size=6, layers=2, draft_vocab=64, aux=(1, 2, 4), kv_heads=None):
    """A random DFlash drafter for ``model`` whose draft vocabulary is a random subset of the target's."""
    cfg = DFlashConfig.for_target(model.config, draft_vocab, mask_token_id=3, block_size=block_size,
                                  num_layers=layers, aux_layer_ids=aux, num_kv_heads=kv_heads)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():  # sharper than the default init: fewer near-ties in the draft argmax
        drafter.lm_head.weight.mul_(20.0)
    drafter.set_vocab(*random_vocab(model.config.vocab_size, draft_vocab))
    return drafter.eval().requires_grad_(False)


def _prompts(n=(5, 11, 3, 8)):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(5, 90, (m,), generator=g).tolist() for m in n]


def test_config_for_targets_and_engine_ids(tiny_models):
    for kind in KINDS:
        model = tiny_models(kind)
        L = model.config.num_hidden_layers
        cfg = DFlashConfig.for_target(model.config, 64, mask_token_id=0, block_size=8, num_layers=2,
                                      aux_layer_ids=(1, 3, L))
        assert cfg.target_layer_ids == [j - 1 for j in cfg.aux_layer_ids] and cfg.max_draft == 7
        assert cfg.hidden_size == model.config.hidden_size and cfg.num_target_layers == L
        assert DFlashConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    model = tiny_models("llama")
    heads = model.config.num_attention_heads  # 4 heads over 2 kv heads: the drafter's own layout replaces it
    own = DFlashConfig.for_target(model.config, 64, mask_token_id=0, num_layers=1, aux_layer_ids=(1, 2),
                                  num_kv_heads=heads)
    assert (own.num_key_value_heads, own.num_attention_heads, own.head_dim) == (heads, heads, model.config.head_dim)
    for bad, says in [({"aux_layer_ids": (0, 1)}, r"\[0\] out of range"), ({"aux_layer_ids": (1, 9)}, "out of range"),
                      ({"block_size": 1}, "block_size"),
                      ({"num_kv_heads": 3}, r"dflash_kv_heads 3\) must divide its 4 attention heads")]:
        args = {"aux_layer_ids": (1, 2), "block_size": 4, **bad}
        with pytest.raises(UserError, match=says):
            DFlashConfig.for_target(model.config, 64, mask_token_id=0, num_layers=1, **args)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_plain_greedy(tiny_models, kind, batch):
    model = tiny_models(kind)
    prompts = _prompts()
    refs = SpecEngine(model, None).generate(prompts, MAX_NEW).tokens
    engine = SpecEngine(model, DFlashProposer(random_drafter(model), model), k=4)
    got = []
    for i in range(0, len(prompts), batch):
        got.extend(engine.generate(prompts[i:i + batch], MAX_NEW).tokens)
    assert got == refs


def test_device_rounds_and_every_k_up_to_the_block(tiny_models):
    model = tiny_models("llama")
    prompts = _prompts()
    refs = SpecEngine(model, None).generate(prompts, MAX_NEW).tokens
    drafter = random_drafter(model, block_size=6)
    for k in (1, 3, 5):
        assert SpecEngine(model, DFlashProposer(drafter, model), k=k, read_len="max").generate(
            prompts, MAX_NEW).tokens == refs
    with pytest.raises(UserError, match="at most 5"):
        SpecEngine(model, DFlashProposer(drafter, model), k=6).generate(prompts[:1], MAX_NEW)


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_drafting_equals_plain_greedy_and_compiles_once_per_role(tiny_models, kind):
    """With the engine's step compiled, the block forward and a round's observe run through
    torch.compile (aot_eager: the traced and functionalised graph, eager kernels): batch 1 and 2,
    per-step and device rounds, tokens equal plain greedy; each role compiles once per (batch, k),
    the prompt's context written eagerly (no variant per prompt width)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = tiny_models(kind)
    prompts = _prompts()
    proposer = DFlashProposer(random_drafter(model), model)
    assert_compiled_greedy_is_plain(model, proposer, prompts, MAX_NEW)
    for role in (DFlashProposer._greedy_eager, DFlashProposer._observe_eager):
        assert len(_debug_get_cache_entry_list(role.__code__)) == 2, role  # batch 1 and batch 2
    with pytest.raises(UserError, match="at most 5"):
        SpecEngine(model, proposer, k=6, compile="aot_eager").generate(prompts[:1], MAX_NEW)


@pytest.mark.parametrize("kind", KINDS)
def test_the_drafts_are_the_training_blocks_and_one_forward(tiny_models, kind):
    """Every round's k drafts are what ``dflash_loss`` computes for the block anchored at the round's
    position (a one-hot teacher at the drafts: all agree), and each round is one drafter forward."""
    from outrider.models import AuxCapture
    from outrider.train.loop.dflash_loss import dflash_loss

    model = tiny_models(kind)
    drafter, k = random_drafter(model, seed=2), 5
    proposer = DFlashProposer(drafter, model)
    rounds, calls, block = [], [], drafter.block

    def counting(*a):
        calls.append(1)
        return block(*a)

    def recording(n, propose=proposer.propose):
        before = len(calls)
        draft = propose(n)
        assert len(calls) - before == 1
        rounds.append((list(proposer.ctx.histories[0]), draft.tokens[0].tolist()))
        return draft

    drafter.block = counting
    proposer.propose = recording
    SpecEngine(model, proposer, k=k).generate(_prompts()[1:2], 14)
    drafter.block = block
    assert len(rounds) > 3
    dv = drafter.config.draft_vocab_size
    draft_of = {int(t): d for d, t in enumerate((torch.arange(dv) + drafter.d2t).tolist())}
    weights = [1.0] * (drafter.config.block_size - 1)
    for history, drafts in rounds:
        seq = torch.tensor([history + drafts])
        L = len(history)
        with AuxCapture(model, drafter.config.aux_layer_ids) as cap:
            model(seq)
            aux = cap.concat()
        width = L + drafter.config.block_size
        seq = torch.nn.functional.pad(seq, (0, width - seq.shape[1]))
        aux = torch.nn.functional.pad(aux, (0, 0, 0, width - aux.shape[1]))
        real = (torch.arange(width) < L + k)[None]
        teacher = torch.zeros(1, width, dv)
        for j, token in enumerate(drafts):
            teacher[0, L - 1 + j, draft_of[token]] = 1.0
        with torch.no_grad():
            out = dflash_loss(drafter, model.get_input_embeddings(), aux, seq, real.long(), teacher, real.long(),
                              weights, agree_map=True, chunk=3)
        assert out.agree[:k, 0, L - 2].tolist() == [True] * k, (L, drafts)


def test_sampled_tokens_follow_the_target_distribution(tiny_models):
    """Sampling with DFlash drafts gives plain sampling's token distribution (two-sample TV)."""
    model = tiny_models("llama")
    rows, prompt = 1500, _prompts()[1]
    plain = SpecEngine(model, None, sampling=SamplingParams(temperature=1.0, seed=11)).generate(
        [prompt] * rows, 4).tokens
    spec = SpecEngine(model, DFlashProposer(random_drafter(model), model), k=3,
                      sampling=SamplingParams(temperature=1.0, seed=90_000)).generate([prompt] * rows, 4).tokens
    other = SpecEngine(make_tiny("llama", 7), None, sampling=SamplingParams(temperature=1.0, seed=11)).generate(
        [prompt] * rows, 4).tokens
    V = model.config.vocab_size

    def hist(outs, pos):
        return torch.bincount(torch.tensor([o[pos] for o in outs]), minlength=V).float() / len(outs)

    for pos in (1, 3):
        tv_same = 0.5 * (hist(plain, pos) - hist(spec, pos)).abs().sum().item()
        tv_other = 0.5 * (hist(plain, pos) - hist(other, pos)).abs().sum().item()
        assert tv_same < 0.12 and tv_same < tv_other / 3, (tv_same, tv_other)


def test_a_drafter_with_its_own_kv_heads_decodes_losslessly_and_reloads_equal(tiny_models, tmp_path):
    """Plain multi-head attention on a GQA target (``num_kv_heads`` = its heads): batch 4 equals plain
    greedy decoding, and the written layout records the drafter's heads, not the target's."""
    model = tiny_models("llama")
    heads = model.config.num_attention_heads
    drafter = random_drafter(model, seed=5, kv_heads=heads)
    assert drafter.layers[0].self_attn.k_proj.out_features == heads * model.config.head_dim
    prompts = _prompts()
    refs = SpecEngine(model, None).generate(prompts, MAX_NEW).tokens
    assert SpecEngine(model, DFlashProposer(drafter, model), k=5).generate(prompts, MAX_NEW).tokens == refs
    write_dflash(drafter, tmp_path / "d", dtype="float32", target_config=model.config)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["num_key_value_heads"] == heads
    reloaded, cfg = load_head(tmp_path / "d", model.config)
    assert cfg == drafter.config and random_check(drafter, reloaded) == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_the_written_layout_reloads_equal(tiny_models, tmp_path, kind):
    model = tiny_models(kind)
    drafter = random_drafter(model, seed=3)
    report = write_dflash(drafter, tmp_path / "d", dtype="float32", target_config=model.config)
    assert report["max_abs_logit_diff"] <= 1e-5 and "LAUNCH.md" in report["files"]
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == drafter.config.block_size
    assert raw["dflash_config"]["target_layer_ids"] == [j - 1 for j in drafter.config.aux_layer_ids]
    assert raw["dflash_config"]["mask_token_id"] == 3
    reloaded, cfg = load_head(tmp_path / "d", model.config)
    assert cfg == drafter.config and random_check(drafter, reloaded) == 0.0
    raw.pop("outrider")  # an engine-only layout (z-lab / SpecForge) reads from the engine fields
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    assert read_dflash(tmp_path / "d").config == drafter.config
    launch = (tmp_path / "d" / "LAUNCH.md").read_text()
    assert '"method": "dflash"' in launch and '"num_speculative_tokens": 5' in launch  # the trained block of 6


def test_refusals_are_one_line(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_models("llama")
    drafter = random_drafter(model)
    write_dflash(drafter, tmp_path / "d", dtype="float32")
    other = make_tiny("llama", 0, layers=2)
    with pytest.raises(UserError, match="reach past the target's 2 layers"):
        read_dflash(tmp_path / "d", other.config)
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    tensors.pop("layers.1.self_attn.k_norm.weight")
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(UserError, match="missing tensors"):
        read_dflash(tmp_path / "d")
    from outrider.interop.drafts import DRAFTS

    write_dflash(drafter, tmp_path / "ok", dtype="float32")
    with pytest.raises(UserError, match="--method dflash"):
        DRAFTS["eagle3-head"].load("eagle3", str(tmp_path / "ok"), model, None, "cpu", torch.float32)
    assert PROPOSERS["dflash"].needs == "dflash"
    assert isinstance(DRAFTS["dflash"].load("dflash", str(tmp_path / "ok"), model, None, "cpu", torch.float32),
                      DFlashDrafter)


def test_inspect_recognises_a_dflash_drafter_and_its_mismatches(tmp_path):
    from tiny import save_tiny

    from outrider.interop.inspect import inspect

    target = save_tiny("llama", tmp_path / "t")
    small = save_tiny("llama", tmp_path / "small", layers=2)
    write_dflash(random_drafter(make_tiny("llama")), tmp_path / "d", dtype="float32")
    report = inspect(target, tmp_path / "d")
    assert report.checks[1].name == "draft" and "DFlash block drafter" in report.checks[1].reason
    assert report.engines["vllm"] and not report.engines["sglang"] and "servable by vLLM" in report.verdict
    bad = inspect(small, tmp_path / "d")
    assert not bad.servable and "reach past the target's 2 layers" in bad.verdict


def test_a_batch_with_nothing_to_learn_still_backpropagates(tiny_models):
    """No counted position (a micro-batch whose learned tokens were all cut): the loss is 0 and still
    a function of every weight, so backward (and DDP) works."""
    from outrider.train.loop.dflash_loss import dflash_loss

    model = tiny_models("llama")
    drafter = random_drafter(model, block_size=4).train().requires_grad_(True)
    ids = torch.randint(5, 90, (2, 10))
    aux = torch.randn(2, 10, drafter.fc.in_features)
    out = dflash_loss(drafter, model.get_input_embeddings(), aux, ids, torch.zeros_like(ids), torch.zeros(2, 10, 64),
                      torch.ones_like(ids), [1.0, 0.8, 0.6], reduction="sum")
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and out.n_tokens == 0
    assert all(p.grad is not None for p in drafter.parameters())


def test_a_folder_without_its_own_lm_head_is_refused(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    write_dflash(random_drafter(tiny_models("llama")), tmp_path / "d", dtype="float32")
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(UserError, match="no lm_head"):
        read_dflash(tmp_path / "d")


def _speculators_dflash():
    try:
        from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    except ImportError as e:
        pytest.skip(f"speculators is not installed ({e}); CI installs it with pip install --no-deps speculators")
    return DFlashDraftModel, DFlashSpeculatorConfig


def test_speculators_class_runs_our_dflash_export_as_we_do(tiny_dir, tmp_path):
    """``export --format speculators``: speculators' own ``DFlashDraftModel`` loads the folder (no
    unexpected or missing tensors, the embedding from the verifier it names, nothing NaN) and its
    layers give our drafter's logits on one context and block; vLLM would serve it non-causally."""
    from transformers import AutoModelForCausalLM

    from outrider.interop.formats.export import export

    DFlashDraftModel, DFlashSpeculatorConfig = _speculators_dflash()
    target_dir = tiny_dir("llama")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    drafter = random_drafter(target, seed=4)
    path = tmp_path / "spec"
    export(drafter, "speculators", path, target=str(target_dir), dtype="float32")
    raw = json.loads((path / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash" and raw["aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str(target_dir.resolve())
    assert raw["sliding_window_non_causal"] is True  # vLLM 0.32 reads false as causal: every layer
    config = DFlashSpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"  # its default, flex attention, is for GPUs
    peer = DFlashDraftModel.from_pretrained(path, config=config, dtype=torch.float32).eval()
    from safetensors.torch import load_file

    ours, theirs = set(load_file(path / "model.safetensors")), set(peer.state_dict())
    assert ours - theirs == set()
    assert theirs - ours - set(peer._keys_to_ignore_on_load_missing) == set()
    assert not [k for k, v in peer.state_dict().items() if v.is_floating_point() and v.isnan().any()]
    assert torch.equal(peer.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(peer.d2t, drafter.d2t) and torch.equal(peer.t2d, drafter.t2d)
    g = torch.Generator().manual_seed(0)
    S, B = 7, drafter.config.block_size
    aux = torch.randn(1, S, drafter.fc.in_features, generator=g)
    ids = torch.randint(4, 90, (1, B), generator=g)
    embeds = peer.embed_tokens(ids)
    with torch.no_grad():
        context = peer.hidden_norm(peer.fc(aux))  # [1, S, H]
        positions = torch.arange(S + B)[None]
        rope = peer.rotary_emb(context, positions)
        h = embeds
        for layer in peer.layers:
            h = layer(hidden_states=h, target_hidden=context, attention_mask=None, position_ids=positions,
                      position_embeddings=rope)
        theirs_logits = peer.lm_head(peer.norm(h))
        mask = torch.ones(1, 1, B, S + B, dtype=torch.bool)
        ours_logits = drafter.compute_logits(drafter.block(embeds, positions[:, S:],
                                                           drafter.context_kv(aux, positions[:, :S]), mask))
    torch.testing.assert_close(theirs_logits, ours_logits, rtol=0, atol=1e-5)
    reloaded = read_dflash(path, target.config)  # ours reads it back, from its engine fields too
    assert reloaded.config == drafter.config and random_check(drafter, reloaded) == 0.0
    raw.pop("outrider")
    (path / "config.json").write_text(json.dumps(raw))
    assert read_dflash(path, target.config).config == drafter.config


def test_speculators_dflash_refusals_are_one_line(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from outrider.interop.formats.export import export

    target_dir = tiny_dir("llama")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    full = random_drafter(target, draft_vocab=target.config.vocab_size)
    with pytest.raises(UserError, match="full-vocabulary") as e:
        export(full, "speculators", tmp_path / "full", target=str(target_dir), dtype="float32")
    assert "\n" not in str(e.value) and not (tmp_path / "full").exists()
    with pytest.raises(UserError, match="pass --target"):
        export(random_drafter(target), "speculators", tmp_path / "none", dtype="float32")
    with pytest.raises(UserError, match="unknown DFlash layout"):
        write_dflash(random_drafter(target), tmp_path / "x", layout="sglang")


def test_engine_layout_drafters_that_compute_otherwise_are_refused(tiny_dir, tmp_path):
    """A speculators or z-lab DFlash folder with sliding layers, anchors drawn by sampling or a causal
    block would load and draft other tokens than its engine: refused in one line. The proposal
    method asks for the k that LAUNCH.md asks for."""
    from transformers import AutoModelForCausalLM

    from outrider.interop.formats.export import export

    target_dir = tiny_dir("llama")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    drafter = random_drafter(target, seed=2)
    for layout, k in (("speculators", 2), ("vllm", None)):
        path = tmp_path / layout
        export(drafter, layout, path, target=str(target_dir), dtype="float32", num_speculative_tokens=k)
        raw = json.loads((path / "config.json").read_text())
        raw.pop("outrider")
        if layout == "speculators":
            assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
            assert '"num_speculative_tokens": 2' in (path / "LAUNCH.md").read_text()
            changes = [{"sample_from_anchor": True},
                       {"transformer_layer_config": {**raw["transformer_layer_config"],
                                                     "layer_types": ["sliding_attention"] * drafter.config.num_hidden_layers}}]
        else:
            changes = [{"dflash_config": {**raw["dflash_config"], "causal": True}},
                       {"layer_types": ["sliding_attention"] * drafter.config.num_hidden_layers}]
        for change in changes:
            (path / "config.json").write_text(json.dumps({**raw, **change}))
            with pytest.raises(UserError, match="would draft other tokens") as e:
                read_dflash(path, target.config)
            assert "\n" not in str(e.value)
        (path / "config.json").write_text(json.dumps(raw))
        assert read_dflash(path, target.config).config == drafter.config


def test_soft_labels_learn_the_targets_distribution(tiny_models):
    """``labels="target"``: each draft's cross-entropy is against the teacher's softmax at its position.
    A teacher that is a near-delta on the sequence's next tokens gives the hard-label loss; a teacher
    that spreads its mass gives another loss; an unknown kind is refused."""
    from outrider.train.loop.dflash_loss import dflash_loss

    model = tiny_models("llama")
    drafter = random_drafter(model, block_size=4)
    V = drafter.config.draft_vocab_size
    g = torch.Generator().manual_seed(1)
    ids = drafter.map_to_target(torch.randint(0, V, (2, 12), generator=g))  # [2, 12] target ids the draft vocab holds
    aux = torch.randn(2, 12, drafter.fc.in_features, generator=g)
    mask = torch.ones_like(ids)
    delta = torch.full((2, 12, V), -1e4)  # teacher[t] predicts x_{t+1}
    draft_ids = {int(t): d for d, t in enumerate(drafter.map_to_target(torch.arange(V)).tolist())}
    for b in range(2):
        for t in range(11):
            delta[b, t, draft_ids[int(ids[b, t + 1])]] = 0.0
    args = (drafter, model.get_input_embeddings(), aux, ids, mask)
    hard = dflash_loss(*args, delta, None, [1.0, 0.8, 0.6], labels="tokens")
    soft = dflash_loss(*args, delta, None, [1.0, 0.8, 0.6], labels="target")
    assert torch.allclose(hard.per_step_loss, soft.per_step_loss, atol=1e-5) and hard.n_tokens == soft.n_tokens > 0
    spread = dflash_loss(*args, torch.randn(2, 12, V, generator=g), None, [1.0, 0.8, 0.6], labels="target")
    assert not torch.allclose(spread.per_step_loss, hard.per_step_loss, atol=1e-3)
    with pytest.raises(ValueError, match="labels must be one of"):
        dflash_loss(*args, delta, None, [1.0, 0.8, 0.6], labels="soft")
