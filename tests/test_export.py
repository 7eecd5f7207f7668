"""Export to SGLang / vLLM / speculators, import of peers' heads, and loading in the peers' classes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import make_tiny, save_tiny

from outrider.errors import UserError
from outrider.heads.eagle3 import Eagle3Config, Eagle3Head
from outrider.interop.checkpoint import head_spec_from_config, load_head, read_head_spec
from outrider.interop.formats import FORMATS
from outrider.interop.formats.export import export, save_head, written_aux_ids
from outrider.models import load_config_dict

LAYERS = 8  # default aux ids (2, 4, 5): distinct and ascending, like a real model's


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("target"), seed=0, layers=LAYERS)


@pytest.fixture(scope="module")
def target(target_dir):
    return make_tiny("llama", seed=0, layers=LAYERS)


def make_head(target_dir, draft_vocab: int = 32, aux_layer_ids=None, seed: int = 1, **options) -> Eagle3Head:
    cfg = Eagle3Config.for_target(load_config_dict(target_dir), draft_vocab_size=draft_vocab,
                                  aux_layer_ids=aux_layer_ids, **options)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a swapped norm would show in the logits
        for p in head.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    ids = torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    head.set_vocab(ids - torch.arange(draft_vocab), t2d)
    return head


def inputs(target, cfg: Eagle3Config, n: int = 7, seed: int = 2):
    """Token ids, their target embeddings and random per-layer target states."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen)  # [1, n]
    with torch.no_grad():
        emb = target.get_input_embeddings()(input_ids)  # [1, n, H]
    states = {j: torch.randn(1, n, cfg.target_hidden_size, generator=gen) for j in range(LAYERS)}
    return input_ids, emb, states


def logits_of(head: Eagle3Head, emb, states) -> torch.Tensor:
    aux = torch.cat([states[j] for j in head.config.aux_layer_ids], dim=-1)  # [1, n, 3*H_t]
    with torch.no_grad():
        logits, _ = head(emb, head.fuse(aux), torch.arange(emb.shape[1])[None])
    return logits  # [1, n, draft_vocab]


@pytest.fixture(scope="module")
def head(target_dir):
    return make_head(target_dir)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_ours_to_format_to_ours_is_exact(fmt, head, target, target_dir, tmp_path):
    ref = logits_of(head, *inputs(target, head.config)[1:])
    report = export(head, fmt, tmp_path / fmt, target=str(target_dir), dtype="float32")
    assert report.files == ["LAUNCH.md", "config.json", "model.safetensors"]
    assert report.max_abs_logit_diff == 0.0
    loaded, cfg = load_head(tmp_path / fmt, target_dir)
    assert cfg == head.config
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    assert torch.equal(logits_of(loaded, *inputs(target, cfg)[1:]), ref)
    save_head(loaded, tmp_path / "ours", target=str(target_dir))  # back to our own layout
    again, cfg2 = load_head(tmp_path / "ours")
    assert cfg2 == head.config
    assert torch.equal(logits_of(again, *inputs(target, cfg2)[1:]), ref)


def test_config_follows_the_contract(head, target_dir, tmp_path):
    export(head, "vllm", tmp_path / "v", target=str(target_dir), dtype="float32")
    cfg = json.loads((tmp_path / "v/config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["norm_before_residual"] is False and cfg["draft_vocab_size"] == 32
    assert cfg["target_hidden_size"] == 64 and cfg["vocab_size"] == 96 and cfg["torch_dtype"] == "float32"
    # vLLM reads the top-level ids verbatim; SGLang reads eagle_config's and (Llama target) adds 1
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["outrider"]["aux_layer_ids"] == [2, 4, 5]
    assert cfg["outrider"]["target"]["name"] == target_dir.name
    assert cfg["outrider"]["target"]["tokenizer"]["vocab_sha256"]
    names = set(load_file(tmp_path / "v/model.safetensors"))
    assert names == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{n}" for n in ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight")}
    launch = (tmp_path / "v/LAUNCH.md").read_text()
    spec = {"method": "eagle3", "model": str((tmp_path / "v").resolve()), "num_speculative_tokens": 3}
    assert f"--speculative-config '{json.dumps(spec)}'" in launch
    assert "--speculative-algorithm EAGLE3" in launch and "PR 25454" in launch  # SGLang serves it too


def test_sglang_format_writes_ids_sglang_shifts_back(head, target_dir, tmp_path):
    report = export(head, "sglang", tmp_path / "s", target=str(target_dir), dtype="float32")
    cfg = json.loads((tmp_path / "s/config.json").read_text())
    assert report.written_aux_layer_ids == [2, 4, 5] and report.written_eagle_aux_layer_ids == [1, 3, 4]
    assert "eagle_config [1, 3, 4]" in report.summary() and "LAUNCH.md" in report.summary()
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # what vLLM reads
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # what SGLang reads
    spec = read_head_spec(tmp_path / "s")
    assert spec.sglang_reads(LAYERS, "llama") == (2, 4, 5)  # SGLang's Llama: +1 to every id
    assert spec.vllm_reads(LAYERS) == (2, 4, 5)
    assert spec.aux_layer_ids == (2, 4, 5)
    launch = (tmp_path / "s/LAUNCH.md").read_text()
    assert "--speculative-algorithm EAGLE3" in launch and "--speculative-eagle-topk 1" in launch
    assert f"--speculative-draft-model-path {(tmp_path / 's').resolve()}" in launch
    # a foreign config with the same written ids but no outrider record is read the same way
    foreign = {k: v for k, v in cfg.items() if k != "outrider"}
    assert head_spec_from_config(foreign).aux_layer_ids == (2, 4, 5)


def test_sglang_id_rules():
    """SGLang adds 1 to eagle_config ids: always for Llama-like targets (models/llama.py), only when the first is
    1 for DeepSeek/Kimi (models/deepseek_v2.py since PR 25454). The top level (vLLM) is always verbatim."""
    for model_type in ("llama", "kimi_k2", None):
        assert written_aux_ids((2, 30, 58), "sglang", model_type)[:2] == ((2, 30, 58), (1, 29, 57))
    assert written_aux_ids((3, 30, 58), "sglang", "kimi_k2")[1] == (3, 30, 58)  # read unshifted (PR 25454)
    assert written_aux_ids((3, 30, 58), "sglang", "llama")[1] == (2, 29, 57)  # read +1
    assert written_aux_ids((1, 30, 58), "sglang", "qwen3")[1] == (0, 29, 57)
    with pytest.raises(UserError, match="DeepSeek/Kimi"):  # 1 is read as 2, 0 as 0
        written_aux_ids((1, 30, 58), "sglang", "deepseek_v3")
    with pytest.raises(UserError, match="pass --target"):
        written_aux_ids((3, 30, 58), "sglang", None)
    assert written_aux_ids((1, 30, 58), "vllm", "deepseek_v3")[:2] == ((1, 30, 58), (1, 30, 58))  # kept, noted
    assert written_aux_ids((2, 30, 58), "speculators", "llama")[:2] == ((2, 30, 58), None)


def test_unsorted_aux_ids_are_written_ascending_with_fc_permuted(target, target_dir, tmp_path):
    head = make_head(target_dir, aux_layer_ids=(5, 2, 4))
    report = export(head, "vllm", tmp_path / "v", dtype="float32")
    assert report.written_aux_layer_ids == [2, 4, 5] and report.notes
    loaded, cfg = load_head(tmp_path / "v")
    assert cfg.aux_layer_ids == (2, 4, 5)
    emb, states = inputs(target, cfg)[1:]
    torch.testing.assert_close(logits_of(loaded, emb, states), logits_of(head, emb, states), rtol=0, atol=1e-5)


def test_repeated_aux_ids_are_refused(target_dir, tmp_path):
    head = make_head(target_dir, aux_layer_ids=(2, 2, 5))
    with pytest.raises(UserError, match="repeat a layer"):
        export(head, "vllm", tmp_path / "v")
    assert not (tmp_path / "v").exists()


def test_bfloat16_export_reloads_to_the_same_logits(head, target_dir, tmp_path):
    report = export(head, "sglang", tmp_path / "b", target=str(target_dir))
    assert report.dtype == "bfloat16" and report.max_abs_logit_diff == 0.0
    tensors = load_file(tmp_path / "b/model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    assert tensors["t2d"].dtype == torch.bool
    assert json.loads((tmp_path / "b/config.json").read_text())["torch_dtype"] == "bfloat16"


def test_a_failed_check_leaves_the_old_export_in_place(head, target_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    export(head, "vllm", out, dtype="float32")
    before = (out / "model.safetensors").read_bytes()
    import outrider.interop.formats.export as ex

    monkeypatch.setattr(ex, "_random_check", lambda a, b: float("nan"))
    with pytest.raises(UserError, match="does not reproduce"):
        export(make_head(target_dir, seed=5), "vllm", out, dtype="float32")
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _checkpoint(head, target_dir, tmp_path, name="h"):
    path = tmp_path / name
    export(head, "vllm", path, target=str(target_dir), dtype="float32")
    return path


def test_unknown_or_missing_tensor_names_fail(head, target_dir, tmp_path):
    path = _checkpoint(head, target_dir, tmp_path)
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, "midlayer.self_attn.q_proj.bias": torch.zeros(64)}, path / "model.safetensors")
    with pytest.raises(UserError, match="unknown tensors.*q_proj.bias"):
        load_head(path)
    save_file({k: v for k, v in tensors.items() if k != "norm.weight"}, path / "model.safetensors")
    with pytest.raises(UserError, match="missing tensors.*norm.weight"):
        load_head(path)


def test_reads_a_trainer_head_folder_with_ids_from_1(target, target_dir, tmp_path):
    """The trainer's layout: the vLLM fields plus an outrider section with head_config and a target name."""
    head = make_head(target_dir, aux_layer_ids=(1, 3, 5))
    path = tmp_path / "trained"
    path.mkdir()
    config = json.loads(json.dumps(_contract_fields(head)))
    config["outrider"] = {"format": "outrider-eagle3-head", "head_config": head.config.to_dict(),
                          "target": str(target_dir), "draft_vocab": {"size": 32}}
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, path / "model.safetensors")
    loaded, cfg = load_head(path, target_dir)
    assert cfg.aux_layer_ids == (1, 3, 5)  # recorded by outrider: not read as SGLang's "first id 1" convention
    emb, states = inputs(target, cfg)[1:]
    assert torch.equal(logits_of(loaded, emb, states), logits_of(head, emb, states))
    report = export(path, "vllm", tmp_path / "v", dtype="float32")
    assert report.written_aux_layer_ids == [1, 3, 5]
    assert json.loads((tmp_path / "v/config.json").read_text())["outrider"]["target"] == {"name": str(target_dir)}
    # the recorded target is a Llama, whose SGLang model adds 1 to every id: (1, 3, 5) is written (0, 2, 4)
    assert export(path, "sglang", tmp_path / "s").written_eagle_aux_layer_ids == [0, 2, 4]


def _contract_fields(head: Eagle3Head) -> dict:
    c = head.config
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size, "hidden_act": c.hidden_act, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
            "tie_word_embeddings": False, "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
            "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids)},
            "torch_dtype": "float32"}


def test_imports_a_specforge_checkpoint(head, target, target_dir, tmp_path):
    """SpecForge writes LlamaForCausalLMEagle3 with eagle_config ids, midlayer.* and embed_tokens."""
    path = _checkpoint(head, target_dir, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["outrider"], cfg["eagle_aux_hidden_state_layer_ids"], cfg["target_hidden_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(path / "model.safetensors")
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    del tensors["t2d"]
    save_file(tensors, path / "model.safetensors")
    loaded, lcfg = load_head(path, target_dir)
    assert lcfg.aux_layer_ids == (2, 4, 5) and torch.equal(loaded.t2d, head.t2d)
    emb, states = inputs(target, lcfg)[1:]
    assert torch.equal(logits_of(loaded, emb, states), logits_of(head, emb, states))


def test_imports_a_safeailab_bin_without_ids_or_vocab_map(target, target_dir, tmp_path):
    """SafeAILab EAGLE-3: pytorch_model.bin, architectures LlamaForCausalLM, engine-default aux ids."""
    head = make_head(target_dir, draft_vocab=96)
    path = tmp_path / "safeailab"
    path.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-6, "vocab_size": 96, "draft_vocab_size": 96, "max_position_embeddings": 1024,
           "tie_word_embeddings": False, "torch_dtype": "float16"}
    (path / "config.json").write_text(json.dumps(cfg))
    state = {k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    torch.save(state, path / "pytorch_model.bin")
    with pytest.raises(UserError, match="names no aux layer ids"):
        load_head(path)
    loaded, lcfg = load_head(path, target_dir)
    assert lcfg.aux_layer_ids == (2, LAYERS // 2, LAYERS - 3)
    assert int(loaded.d2t.abs().sum()) == 0 and bool(loaded.t2d.all())
    emb, states = inputs(target, lcfg)[1:]
    assert torch.equal(logits_of(loaded, emb, states), logits_of(head, emb, states))


def test_mismatches_against_the_target_are_user_errors(head, target_dir, tmp_path):
    path = _checkpoint(head, target_dir, tmp_path)
    base = load_config_dict(target_dir)
    for patch, message in (({"hidden_size": 128}, "hidden size"), ({"vocab_size": 200}, "vocabulary of 96"),
                           ({"num_hidden_layers": 4}, "out of range"), ({"vocab_size": 16}, "larger than")):
        with pytest.raises(UserError, match=message):
            load_head(path, {**base, **patch})


def test_bad_files_are_user_errors(head, target_dir, tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        load_head(tmp_path)
    path = _checkpoint(head, target_dir, tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(UserError, match="corrupt or truncated"):
        load_head(path)
    with pytest.raises(UserError, match="unknown export format"):
        export(head, "onnx", tmp_path / "x")


# --------------------------------------------------------------------------------------------
# The peers' own classes. CI installs them with:
#   pip install --no-deps specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0
#   pip install openai datasets loguru
# (their full installs pin torch 2.11 + sglang 0.5.14, resp. transformers<=5.19 + CUDA torchvision).
# --------------------------------------------------------------------------------------------

def _import_or_skip(module: str, package: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        pytest.skip(f"{package} is not installed ({e}); CI installs it with pip install --no-deps {package}")


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_specforge_class_loads_our_export(fmt, head, target, target_dir, tmp_path):
    llama3_eagle = _import_or_skip("specforge.modeling.draft.llama3_eagle", "specforge==0.2.0")
    from transformers import LlamaConfig

    export(head, fmt, tmp_path / fmt, target=str(target_dir), dtype="float32", include_embeddings=True)
    # Built from config.json and loaded strictly: transformers 5.24's from_pretrained leaves
    # SpecForge's non-persistent rotary cache uninitialised (SpecForge pins transformers 5.8).
    peer = llama3_eagle.LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(tmp_path / fmt)).float().eval()
    result = peer.load_state_dict(load_file(tmp_path / fmt / "model.safetensors"), strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    input_ids, emb, states = inputs(target, head.config)
    aux = torch.cat([states[j] for j in head.config.aux_layer_ids], dim=-1)
    # Its RMSNorm is torch.compile'd: run it eagerly, in a patch scoped to this call.
    with torch.no_grad(), torch._dynamo.config.patch(disable=True):
        theirs = peer.lm_head(peer(hidden_states=aux, inputs_embeds=peer.embed_input_ids(input_ids)))
    torch.testing.assert_close(theirs, logits_of(head, emb, states), rtol=0, atol=1e-5)
    assert torch.equal(peer.d2t, head.d2t)


@pytest.mark.parametrize("draft_vocab", [32, 96])
def test_speculators_class_loads_our_export(draft_vocab, target, target_dir, tmp_path):
    core = _import_or_skip("speculators.models.eagle3", "speculators==0.9.0")
    head = make_head(target_dir, draft_vocab=draft_vocab)
    path = tmp_path / "spec"
    export(head, "speculators", path, target=str(target_dir), dtype="float32", include_embeddings=True)
    config = core.Eagle3SpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"  # its default, flex attention, is for GPUs
    peer = core.Eagle3DraftModel.from_pretrained(path, config=config, dtype=torch.float32).eval()
    ours, theirs = set(load_file(path / "model.safetensors")), set(peer.state_dict())
    assert ours - theirs == set()  # unexpected
    assert theirs - ours - set(peer._keys_to_ignore_on_load_missing) == set()  # missing
    assert not [k for k, v in peer.state_dict().items() if v.is_floating_point() and v.isnan().any()]
    input_ids, emb, states = inputs(target, head.config)
    aux = torch.cat([states[j] for j in head.config.aux_layer_ids], dim=-1)
    captured = []
    peer.lm_head.register_forward_hook(lambda module, args, out: captured.append(out))
    n = input_ids.shape[1]
    with torch.no_grad():
        peer(hidden_states=aux, input_ids=input_ids, document_ids=torch.zeros(1, n, dtype=torch.long),
             position_ids=torch.arange(n)[None], ttt_steps=1)
    torch.testing.assert_close(captured[0], logits_of(head, emb, states), rtol=0, atol=1e-5)
    if draft_vocab < 96:
        assert torch.equal(peer.d2t, head.d2t)
