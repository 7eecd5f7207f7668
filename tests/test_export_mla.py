"""Exports of MLA heads and EAGLE 3.1 heads: round trips, the engines' loaders' name maps, and the
speculators format run by speculators' own class (norms, sliding window, aux id L, verifier, embedding)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import make_tiny, save_tiny

from outrider.errors import UserError
from outrider.interop.checkpoint import head_spec_from_config, load_head
from outrider.heads.eagle3 import Eagle3Config, Eagle3Head
from outrider.interop.formats.export import export, save_head
from outrider.models import load_config_dict
from outrider.train.loop.ttt import StepKV, ttt_block_mask, ttt_step_mask

LAYERS = 8  # default aux ids (2, 4, 5)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {kind: save_tiny(kind, root / kind, seed=0, layers=LAYERS) for kind in ("llama", "deepseek_v3")}


@pytest.fixture(scope="module")
def models():
    return {kind: make_tiny(kind, seed=0, layers=LAYERS) for kind in ("llama", "deepseek_v3")}


def make_head(target_dir, attention="mla", draft_vocab=32, aux=None, seed=1, **options) -> Eagle3Head:
    cfg = Eagle3Config.for_target(load_config_dict(target_dir), draft_vocab, aux_layer_ids=aux, attention=attention,
                                  **options)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg).eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)  # norms away from 1: a swapped or dropped norm shows in the logits
    ids = torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    head.set_vocab(ids - torch.arange(draft_vocab), t2d)
    return head


def inputs(model, cfg: Eagle3Config, n: int = 12, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen)
    with torch.no_grad():
        emb = model.get_input_embeddings()(input_ids)
    states = {j: torch.randn(1, n, cfg.target_hidden_size, generator=gen) for j in range(LAYERS + 1)}
    return input_ids, emb, states


def logits_of(head, emb, states):
    aux = torch.cat([states[j] for j in head.config.aux_layer_ids], dim=-1)
    with torch.no_grad():
        return head(emb, head.fuse(aux), torch.arange(emb.shape[1])[None])[0]


# ---------------------------------------------------------------------------------------------
# MLA heads: round trip and the config both engines read


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_mla_round_trip_is_exact(kind, fmt, targets, models, tmp_path):
    head = make_head(targets[kind], fc_norm=True, norm_output=True)
    ref = logits_of(head, *inputs(models[kind], head.config)[1:])
    report = export(head, fmt, tmp_path / fmt, target=str(targets[kind]), dtype="float32")
    assert report.max_abs_logit_diff == 0.0
    loaded, cfg = load_head(tmp_path / fmt, targets[kind])
    assert cfg == head.config and torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    assert torch.equal(logits_of(loaded, *inputs(models[kind], cfg)[1:]), ref)
    save_head(loaded, tmp_path / "ours", target=str(targets[kind]))
    again, cfg2 = load_head(tmp_path / "ours")
    assert cfg2 == head.config and torch.equal(logits_of(again, *inputs(models[kind], cfg2)[1:]), ref)


def test_mla_config_and_tensors_follow_the_engines_contract(targets, tmp_path):
    head = make_head(targets["deepseek_v3"], fc_norm=True)
    c = head.config
    export(head, "vllm", tmp_path / "v", target=str(targets["deepseek_v3"]), dtype="bfloat16")
    cfg = json.loads((tmp_path / "v/config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert cfg[key] == getattr(c, key) and cfg[key] > 0
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == 64 and cfg["num_attention_heads"] == 4
    assert cfg["target_hidden_size"] == 64 and cfg["draft_vocab_size"] == 32 and cfg["fc_norm"] is True
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang (+1)
    assert cfg["rope_scaling"]["rope_theta"] == c.rope_theta  # vLLM's MLA draft reads theta from the dict only
    tensors = load_file(tmp_path / "v/model.safetensors")
    assert tensors["d2t"].dtype == torch.int64 and tensors["fc.weight"].dtype == torch.bfloat16
    H, nh = c.hidden_size, c.num_attention_heads
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    assert shapes["layers.0.self_attn.q_a_proj.weight"] == (c.q_lora_rank, 2 * H)
    assert shapes["layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (c.kv_lora_rank + c.qk_rope_head_dim, 2 * H)
    assert shapes["layers.0.self_attn.kv_b_proj.weight"] == (nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    assert not [k for k in tensors if k.startswith("midlayer.")]
    launch = (tmp_path / "v/LAUNCH.md").read_text()
    assert "vllm serve" in launch and "sglang.launch_server" in launch and "PR 36361" in launch
    with pytest.raises(UserError, match="Llama \\(GQA\\) drafts only"):
        export(head, "speculators", tmp_path / "s", target=str(targets["deepseek_v3"]))


def test_published_kimi_mla_config_is_read_as_each_engine_reads_it():
    """A K2.5 MLA draft config as published: nested ids [1, 29, 57] (SGLang: +1), top-level [2, 30, 58] (vLLM),
    head_dim 128 (not the rope width), yarn as the target's."""
    cfg = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
           "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128,
           "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": 163840,
           "draft_vocab_size": 163840, "rope_theta": 50000.0, "max_position_embeddings": 262144,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True},
           "eagle_aux_hidden_state_layer_ids": [2, 30, 58], "tie_word_embeddings": False}
    spec = head_spec_from_config(cfg)
    assert spec.config.attention == "mla" and spec.config.head_dim == 192 and spec.layout == "layers.0"
    assert spec.vllm_reads(61) == spec.sglang_reads(61, "kimi_k2") == spec.aux_layer_ids == (2, 30, 58)
    head_cfg = spec.eagle3_config(61, "kimi_k2")
    assert head_cfg.rope_scaling["factor"] == 64.0 and head_cfg.kv_lora_rank == 512
    nested_only = {k: v for k, v in cfg.items() if k != "eagle_aux_hidden_state_layer_ids"}
    nested_only["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}
    spec = head_spec_from_config(nested_only)
    assert spec.aux_layer_ids is None  # SGLang's reading of a first id 2 depends on the target
    assert spec.intended_aux_ids(61, "kimi_k2") == (2, 30, 58)  # DeepSeek/Kimi: unshifted (PR 25454)
    assert spec.intended_aux_ids(61, "llama") == (3, 31, 59)  # a Llama target: +1
    with pytest.raises(UserError, match="pass the target"):
        spec.eagle3_config()


# ---------------------------------------------------------------------------------------------
# The engines' loaders, as data. Each maps checkpoint names to its own parameters; the sets below
# are the parameters their draft classes build. A test loads our export through the map and asks
# for no unknown name, no parameter left unloaded (the embedding is the target's in both engines),
# and the shapes each fused parameter assembles.
#   SGLang python/sglang/srt/models/kimi_k25_eagle3.py @40449c10 (PR 24826) + fc_norm/norm_output (PR 26506):
#     Eagle3DeepseekV2ForCausalLM.load_weights
#   vLLM vllm/model_executor/models/deepseek_eagle3.py @03590193: hf_to_vllm_mapper, load_weights
#   vLLM vllm/model_executor/models/llama_eagle3.py (2026 text with norm_before_fc/fc_norm/norm_output)
#   SGLang python/sglang/srt/models/llama_eagle3.py (2026 text with fc_norm/norm_output, legacy_name_map)

def _stack(loaded: dict, name: str, rows: int, cols: int) -> None:
    r, c = loaded.get(name, (0, cols))
    assert c == cols, name
    loaded[name] = (r + rows, cols)


def sglang_mla_load(names: dict[str, tuple]) -> tuple[dict, list]:
    loaded, skipped, cached = {}, [], {}
    for name, shape in names.items():
        if name == "d2t" or name.endswith(".d2t"):
            loaded["hot_token_id"] = shape
            continue
        if name == "t2d" or name.endswith(".t2d"):
            continue
        mapped = re.sub(r"^layers\.0\.", "midlayer.", name)
        if not mapped.startswith("lm_head."):
            mapped = f"model.{mapped}"
        if ".gate_proj" in mapped or ".up_proj" in mapped:
            _stack(loaded, mapped.replace(".gate_proj", ".gate_up_proj").replace(".up_proj", ".gate_up_proj"), *shape)
            continue
        if "q_a_proj" in mapped or "kv_a_proj_with_mqa" in mapped:
            cached[mapped] = shape
            continue
        loaded[mapped] = shape
    q = [k for k in cached if "q_a_proj" in k]
    for qn in q:
        kvn = qn.replace("q_a_proj", "kv_a_proj_with_mqa")
        fused = qn.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")
        loaded[fused] = (cached[qn][0] + cached[kvn][0], cached[qn][1])
    return loaded, skipped


def sglang_mla_params(c: Eagle3Config) -> dict[str, tuple]:
    H, Ht, nh, I = c.hidden_size, c.target_hidden_size, c.num_attention_heads, c.intermediate_size
    rq, rkv, dn, dr, dv = c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    a = "model.midlayer.self_attn."
    params = {"model.fc.weight": (H, 3 * Ht), a + "fused_qkv_a_proj_with_mqa.weight": (rq + rkv + dr, 2 * H),
              a + "q_a_layernorm.weight": (rq,), a + "q_b_proj.weight": (nh * (dn + dr), rq),
              a + "kv_a_layernorm.weight": (rkv,), a + "kv_b_proj.weight": (nh * (dn + dv), rkv),
              a + "o_proj.weight": (H, nh * dv), "model.midlayer.mlp.gate_up_proj.weight": (2 * I, H),
              "model.midlayer.mlp.down_proj.weight": (H, I), "model.norm.weight": (H,),
              "lm_head.weight": (c.draft_vocab_size, H), "hot_token_id": (c.draft_vocab_size,),
              **{f"model.midlayer.{n}.weight": (H,) for n in ("input_layernorm", "hidden_norm",
                                                              "post_attention_layernorm")}}
    if c.fc_norm:
        params.update({f"model.fc_norm.{i}.weight": (Ht,) for i in range(3)})
    return params


_VLLM_STACKED = {".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj", ".q_a_proj": ".fused_qkv_a_proj",
                 ".kv_a_proj_with_mqa": ".fused_qkv_a_proj", ".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj",
                 ".v_proj": ".qkv_proj"}


def vllm_load(names: dict[str, tuple], norm_before_fc: bool = False) -> tuple[dict, list]:
    loaded, skipped = {}, []
    for name, shape in names.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        if "input_norm." in name and not norm_before_fc:
            skipped.append(name)
            continue
        for src, dst in _VLLM_STACKED.items():
            if src in name:
                _stack(loaded, name.replace(src, dst), *shape)
                break
        else:
            loaded[name] = shape
    return loaded, skipped


def vllm_mla_params(c: Eagle3Config) -> dict[str, tuple]:
    sg = sglang_mla_params(c)
    out = {k.replace("model.midlayer.", "model.layers.0.").replace("fused_qkv_a_proj_with_mqa", "fused_qkv_a_proj"): v
           for k, v in sg.items() if k != "hot_token_id"}
    out["draft_id_to_target_id"] = (c.draft_vocab_size,)
    return out


def vllm_llama_params(c: Eagle3Config) -> dict[str, tuple]:
    H, Ht, nh, I, d = c.hidden_size, c.target_hidden_size, c.num_attention_heads, c.intermediate_size, c.head_dim
    a = "model.layers.0.self_attn."
    params = {"model.fc.weight": (H, 3 * Ht), a + "qkv_proj.weight": ((nh + 2 * c.num_key_value_heads) * d, 2 * H),
              a + "o_proj.weight": (H, nh * d), "model.layers.0.mlp.gate_up_proj.weight": (2 * I, H),
              "model.layers.0.mlp.down_proj.weight": (H, I), "model.norm.weight": (H,),
              "lm_head.weight": (c.draft_vocab_size, H), "draft_id_to_target_id": (c.draft_vocab_size,),
              **{f"model.layers.0.{n}.weight": (H,) for n in ("input_layernorm", "hidden_norm",
                                                              "post_attention_layernorm")}}
    if c.fc_norm:
        params.update({f"model.fc_norm.{i}.weight": (Ht,) for i in range(3)})
    if c.norm_before_fc:
        params["model.input_norm.weight"] = (3 * Ht,)
    return params


def sglang_llama_load(names: dict[str, tuple], params: set[str]) -> tuple[dict, list]:
    legacy = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
              "aux_norm_high": "fc_norm.2"}
    loaded, skipped = {}, []
    for name, shape in names.items():
        for old, new in legacy.items():
            if old in name:
                name = name.replace(old, new)
        if "d2t" in name:
            loaded["hot_token_id"] = shape
            continue
        if "t2d" in name:
            continue
        for src in (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj"):
            if src in name:
                name = name.replace(src, _VLLM_STACKED[src])
                _stack(loaded, name if name in params else f"model.{name}", *shape)
                break
        else:
            target = name if name in params else f"model.{name}"
            if target in params:
                loaded[target] = shape
            else:
                skipped.append(name)  # SGLang skips names it has no parameter for, silently
    return loaded, skipped


def sglang_llama_params(c: Eagle3Config) -> dict[str, tuple]:
    out = {k: v for k, v in vllm_llama_params(c).items() if k not in ("draft_id_to_target_id", "model.input_norm.weight")}
    out["hot_token_id"] = (c.draft_vocab_size,)
    return out


def _names(path) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in load_file(path / "model.safetensors").items()}


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
@pytest.mark.parametrize("options", [{}, {"fc_norm": True, "norm_output": True}])
def test_mla_exports_satisfy_both_engines_loaders(fmt, options, targets, tmp_path):
    head = make_head(targets["deepseek_v3"], **options)
    export(head, fmt, tmp_path / fmt, target=str(targets["deepseek_v3"]), dtype="float32")
    names = _names(tmp_path / fmt)
    loaded, skipped = sglang_mla_load(names)
    assert skipped == [] and loaded == sglang_mla_params(head.config)
    loaded, skipped = vllm_load(names)
    assert skipped == [] and loaded == vllm_mla_params(head.config)
    # both loaders read the other decoder-layer prefix as well (a midlayer.* MLA checkpoint)
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in names.items()}
    assert sglang_mla_load(renamed)[0] == sglang_mla_params(head.config)
    assert vllm_load(renamed)[0] == vllm_mla_params(head.config)


@pytest.mark.parametrize("options", [{"fc_norm": True, "norm_output": True}, {"norm_before_fc": True}])
def test_gqa_3_1_exports_satisfy_both_engines_loaders(options, targets, tmp_path):
    head = make_head(targets["llama"], attention="gqa", **options)
    export(head, "vllm", tmp_path / "v", target=str(targets["llama"]), dtype="float32")
    names = _names(tmp_path / "v")
    loaded, skipped = vllm_load(names, norm_before_fc=head.config.norm_before_fc)
    assert skipped == [] and loaded == vllm_llama_params(head.config)
    params = sglang_llama_params(head.config)
    loaded, skipped = sglang_llama_load(names, set(params))
    assert loaded == params
    # SGLang's Llama draft without PR 32334 has no input_norm: it would skip it silently, which inspect flags
    assert skipped == (["input_norm.weight"] if head.config.norm_before_fc else [])


# ---------------------------------------------------------------------------------------------
# speculators' own class: the 3.1 options, the sliding window, the verifier and the embedding

def _speculators():
    try:
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    except ImportError as e:
        pytest.skip(f"speculators is not installed ({e})")
    return Eagle3DraftModel, Eagle3SpeculatorConfig


def _our_steps(head, emb_fn, aux, input_ids, steps):
    """Our TTT unroll's logits per step (tokens teacher-forced as speculators feeds them)."""
    S = input_ids.shape[1]
    kv, out = StepKV(), []
    real, window = torch.ones(1, S, dtype=torch.bool), head.config.sliding_window
    mask = ttt_block_mask(real, steps)
    hidden = head.fuse(aux)
    pos = torch.arange(S)[None]
    for i in range(steps):
        ids = torch.cat([input_ids[:, i:], input_ids.new_zeros(1, i)], dim=1)
        q, k, v = head.before_attention(emb_fn(ids), hidden, pos + i)
        step_mask = ttt_step_mask(real, i, window) if window else mask[..., : (i + 1) * S]
        hidden = head.after_attention(hidden, head.attend(q, k, v, step_mask, kv))
        out.append(head.compute_logits(hidden))
    return out


def _their_steps(peer, aux, input_ids, steps):
    captured = []
    handle = peer.lm_head.register_forward_hook(lambda module, args, out: captured.append(out))
    n = input_ids.shape[1]
    try:
        with torch.no_grad():
            peer(hidden_states=aux, input_ids=input_ids, document_ids=torch.zeros(1, n, dtype=torch.long),
                 position_ids=torch.arange(n)[None], ttt_steps=steps)
    finally:
        handle.remove()
    return captured


@pytest.mark.parametrize("options, steps", [
    ({"fc_norm": True, "norm_output": True, "norm_before_residual": True}, 3),
    ({"norm_before_fc": True, "sliding_window": 5}, 1),  # speculators trains windows by index: one step agrees
])
def test_speculators_runs_our_3_1_export_as_we_do(options, steps, targets, models, tmp_path):
    Eagle3DraftModel, Eagle3SpeculatorConfig = _speculators()
    head = make_head(targets["llama"], attention="gqa", **options)
    path = tmp_path / "spec"
    export(head, "speculators", path, target=str(targets["llama"]), dtype="float32")
    config = Eagle3SpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"
    peer = Eagle3DraftModel.from_pretrained(path, config=config, dtype=torch.float32).eval()
    assert peer.uses_sliding_window_attn == bool(head.config.sliding_window)
    input_ids, emb, states = inputs(models["llama"], head.config)
    aux = torch.cat([states[j] for j in head.config.aux_layer_ids], dim=-1)
    theirs = _their_steps(peer, aux, input_ids, steps)
    with torch.no_grad():
        ours = _our_steps(head, models["llama"].get_input_embeddings(), aux, input_ids, steps)
    for i in range(steps):
        S = input_ids.shape[1] - i  # speculators' rows past the end see padding tokens: compare the rest
        torch.testing.assert_close(theirs[i][:, :S], ours[i][:, :S], rtol=0, atol=2e-5)


def test_speculators_export_names_a_real_verifier_and_carries_the_embedding(targets, models, tmp_path, monkeypatch):
    Eagle3DraftModel, Eagle3SpeculatorConfig = _speculators()
    from outrider import assets

    monkeypatch.setattr(assets, "default_model_dir", lambda: targets["llama"])  # `default` resolves to the tiny target
    head = make_head(targets["llama"], attention="gqa")
    with pytest.raises(UserError, match="pass --target"):  # nothing says which target: refused
        export(head, "speculators", tmp_path / "none")
    folder = tmp_path / "trained"
    save_head(head, folder, target="default")  # the trainer records the alias it was given
    export(folder, "speculators", tmp_path / "spec", dtype="float32")  # no --target: the recorded one
    cfg = json.loads((tmp_path / "spec/config.json").read_text())
    verifier = cfg["speculators_config"]["verifier"]["name_or_path"]
    assert verifier != "default" and verifier == str(targets["llama"].resolve())
    tensors = load_file(tmp_path / "spec/model.safetensors")
    assert torch.equal(tensors["embed_tokens.weight"], models["llama"].get_input_embeddings().weight)
    config = Eagle3SpeculatorConfig.from_pretrained(tmp_path / "spec")
    config.transformer_layer_config._attn_implementation = "eager"
    peer = Eagle3DraftModel.from_pretrained(tmp_path / "spec", config=config, dtype=torch.float32).eval()
    assert torch.equal(peer.embed_tokens.weight, models["llama"].get_input_embeddings().weight)  # no zeros
    input_ids, emb, states = inputs(models["llama"], head.config)
    aux = torch.cat([states[j] for j in head.config.aux_layer_ids], dim=-1)
    torch.testing.assert_close(_their_steps(peer, aux, input_ids, 1)[0], logits_of(head, emb, states),
                               rtol=0, atol=2e-5)


@pytest.fixture(scope="module")
def speculators_trained(targets, tmp_path_factory):
    """A head as speculators' trainer leaves it by default: norm_before_residual, norm_before_fc and
    norm_output on, a sliding window (here 6), and aux id L (the last layer's output)."""
    Eagle3DraftModel, Eagle3SpeculatorConfig = _speculators()
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    target = targets["llama"]
    tcfg = load_config_dict(target)
    layer = LlamaConfig(**{k: tcfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                "num_attention_heads", "num_key_value_heads", "head_dim",
                                                "max_position_embeddings", "rms_norm_eps")},
                        num_hidden_layers=1, sliding_window=6, layer_types=["sliding_attention"])
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=32, norm_before_residual=True, norm_before_fc=True,
        norm_output=True, eagle_aux_hidden_state_layer_ids=[2, 4, LAYERS],
        speculators_config=SpeculatorsConfig(algorithm="eagle3", default_proposal_method="greedy",
                                             proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                                             verifier=VerifierConfig(name_or_path=str(target), architectures=[])))
    torch.manual_seed(5)
    model = Eagle3DraftModel(config)
    ids = torch.randperm(96)[:32].sort().values
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(32))
    model.load_verifier_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("verifier", "embed_tokens")):
                continue
            p.copy_(torch.rand_like(p) + 0.5 if p.ndim == 1 else torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("specheads") / "trained"
    model.save_pretrained(path)
    return path, model.eval()


def test_a_speculators_default_head_imports_with_its_norms_window_and_aux_id_L(speculators_trained, targets, models):
    path, peer = speculators_trained
    loaded, cfg = load_head(path, targets["llama"])
    assert (cfg.norm_before_residual, cfg.norm_before_fc, cfg.norm_output) == (True, True, True)
    assert cfg.sliding_window == 6 and cfg.aux_layer_ids == (2, 4, LAYERS)
    input_ids, emb, states = inputs(models["llama"], cfg, n=20)  # past the window
    aux = torch.cat([states[j] for j in cfg.aux_layer_ids], dim=-1)
    torch.testing.assert_close(_their_steps(peer, aux, input_ids, 1)[0], logits_of(loaded, emb, states),
                               rtol=0, atol=2e-5)
    # without honouring the window the logits past it differ (the import bug this guards against)
    full = Eagle3Head(replace(cfg, sliding_window=0))
    full.load_state_dict(loaded.state_dict())
    assert not torch.allclose(logits_of(full, emb, states)[:, 6:], logits_of(loaded, emb, states)[:, 6:], atol=1e-3)


def test_a_speculators_head_without_window_imports_over_several_steps(speculators_trained, targets, models, tmp_path):
    """norm_before_residual and norm_output act from the second step on: three steps agree."""
    path, _ = speculators_trained
    cfg = json.loads((path / "config.json").read_text())
    for key in ("sliding_window", "layer_types"):
        cfg["transformer_layer_config"].pop(key, None)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(cfg))
    save_file(load_file(path / "model.safetensors"), plain / "model.safetensors")
    loaded, hcfg = load_head(plain, targets["llama"])
    assert hcfg.sliding_window == 0
    Eagle3DraftModel, Eagle3SpeculatorConfig = _speculators()
    config = Eagle3SpeculatorConfig.from_pretrained(plain)
    config.transformer_layer_config._attn_implementation = "eager"
    peer = Eagle3DraftModel.from_pretrained(plain, config=config, dtype=torch.float32).eval()
    assert not peer.uses_sliding_window_attn
    input_ids, emb, states = inputs(models["llama"], hcfg)
    aux = torch.cat([states[j] for j in hcfg.aux_layer_ids], dim=-1)
    theirs = _their_steps(peer, aux, input_ids, 3)
    with torch.no_grad():
        ours = _our_steps(loaded, models["llama"].get_input_embeddings(), aux, input_ids, 3)
    for i in range(3):
        S = input_ids.shape[1] - i
        torch.testing.assert_close(theirs[i][:, :S], ours[i][:, :S], rtol=0, atol=2e-5)
