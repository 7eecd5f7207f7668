"""outrider inspect: verdicts on config-only fixtures shaped like real models, and on exported heads."""

from __future__ import annotations

import json
import shutil
import sys

import fixtures as fx
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import save_tiny

from outrider.errors import UserError
from outrider.heads.eagle3 import Eagle3Config, Eagle3Head
from outrider.interop.formats.export import export
from outrider.interop.inspect import FAIL, PASS, WARN, inspect, render, to_json
from outrider.models import load_config_dict, tokenizer_fingerprint


def by_name(report, name, engine=None):
    found = [c for c in report.checks if c.name == name and c.engine == engine]
    assert len(found) == 1, (name, engine, [(c.name, c.engine) for c in report.checks])
    return found[0]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    d = tmp_path_factory.mktemp("zoo")
    return {"k25": fx.kimi_k25(d / "Kimi-K2.5"), "k2": fx.kimi_k2(d / "Kimi-K2-Instruct"),
            "dsv3": fx.deepseek_v3(d / "DeepSeek-V3"), "head": fx.kimi_k2_eagle3_head(d / "kimi-k2-eagle3"),
            "root": d}


def test_k2_head_on_k25_passes_shapes_and_warns_acceptance_unknown(zoo):
    report = inspect(zoo["k25"], zoo["head"])
    assert report.servable and report.exit_code == 0 and report.engines == {"vllm": True, "sglang": True}
    for name in ("vocab size", "draft vocabulary", "hidden size", "aux layer ids"):
        assert by_name(report, name).status == PASS
    assert by_name(report, "draft architecture", "vllm").status == PASS
    assert by_name(report, "draft architecture", "sglang").status == PASS
    trained = by_name(report, "trained for")
    assert trained.status == WARN
    assert trained.reason.startswith("acceptance unknown: trained for moonshotai/Kimi-K2-Instruct")
    assert by_name(report, "attention", "vllm").status == WARN  # MLA target: separate draft attention backend
    assert by_name(report, "max positions").status == WARN  # 131072 < K2.5's 262144
    assert report.target_info["model_type"] == "kimi_k2" and report.target_info["num_experts"] == 384
    assert "see warnings" in report.verdict


def test_k2_head_on_k2_is_trained_for_it(zoo):
    report = inspect(zoo["k2"], zoo["head"])
    assert by_name(report, "trained for").status == PASS
    assert by_name(report, "max positions").status == PASS


def test_wrong_hidden_size_fails(zoo, tmp_path):
    head = fx.kimi_k2_eagle3_head(tmp_path / "h", target_hidden_size=4096)
    report = inspect(zoo["k25"], head)
    assert by_name(report, "hidden size").status == FAIL
    assert not report.servable and report.exit_code == 1 and report.verdict.startswith("not servable: hidden size")


def test_deepseek_v3_with_mtp_gets_mtp_recommended(zoo):
    report = inspect(zoo["dsv3"])
    assert by_name(report, "method: mtp").status == PASS
    assert report.recommendation.startswith("mtp") and report.exit_code == 0


def test_kimi_k25_without_mtp_gets_eagle3_recommended(zoo):
    report = inspect(zoo["k25"])
    assert by_name(report, "method: mtp").status == FAIL
    assert by_name(report, "method: eagle3").status == PASS
    assert report.recommendation.startswith("eagle3") and "top-k 1" in report.recommendation


@pytest.mark.parametrize("overrides, message", [
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 70], "use_aux_hidden_state": True}}, "beyond"),
    ({"draft_vocab_size": 200000}, "larger than the target"),
])
def test_bad_drafts_are_user_errors(zoo, tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        inspect(zoo["k25"], fx.kimi_k2_eagle3_head(tmp_path / "h", **overrides))


def test_missing_or_unreadable_files_are_user_errors(zoo, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        inspect(zoo["k25"], tmp_path / "empty")
    with pytest.raises(UserError, match="model not found"):
        inspect(tmp_path / "nowhere")
    head = fx.kimi_k2_eagle3_head(tmp_path / "h")
    (head / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="corrupt or truncated"):
        inspect(zoo["k25"], head)


def test_aux_ids_starting_at_1_follow_sglang_and_warn(zoo, tmp_path):
    head = fx.kimi_k2_eagle3_head(tmp_path / "h", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 29, 57]})
    report = inspect(zoo["k2"], head)
    assert by_name(report, "aux id convention").status == WARN
    assert by_name(report, "aux ids as read", "sglang").reason == "SGLang captures [2, 30, 58]"
    # vLLM reads only top-level ids: without them it falls back to (2, L//2, L-3), which agrees here
    assert by_name(report, "aux ids as read", "vllm").status == PASS


def test_ids_only_in_eagle_config_that_vllm_would_replace_fail_for_vllm(zoo, tmp_path):
    head = fx.kimi_k2_eagle3_head(tmp_path / "h", eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 20, 40]})
    report = inspect(zoo["k2"], head)
    vllm = by_name(report, "aux ids as read", "vllm")
    assert vllm.status == FAIL and "[2, 30, 58]" in vllm.reason and "--format vllm" in vllm.reason
    assert report.engines == {"vllm": False, "sglang": True} and report.servable


def test_speculators_head_is_for_vllm_only(zoo, tmp_path):
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "moonshotai/Kimi-K2.5", "architectures": []}},
              "transformer_layer_config": {"model_type": "llama", "hidden_size": 7168, "num_attention_heads": 64,
                                           "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 18432,
                                           "vocab_size": 163840, "num_hidden_layers": 1,
                                           "max_position_embeddings": 262144},
              "draft_vocab_size": 32000, "target_hidden_size": 7168, "norm_before_residual": False,
              "eagle_aux_hidden_state_layer_ids": [2, 30, 58]}
    path = tmp_path / "spec"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    report = inspect(zoo["k25"], path)
    assert report.engines == {"vllm": True, "sglang": False}
    assert by_name(report, "trained for").status == PASS  # the verifier is named Kimi-K2.5


def test_kimi_tiktoken_tokenizers_match(zoo, monkeypatch):
    pytest.importorskip("tiktoken")
    a, b = tokenizer_fingerprint(zoo["k25"]), tokenizer_fingerprint(zoo["k2"])
    assert a["kind"] == "tiktoken" and a["vocab_sha256"] == b["vocab_sha256"]
    assert a["chat_template_sha256"] == b["chat_template_sha256"] and a["specials_sha256"] == b["specials_sha256"]
    changed = zoo["root"] / "k25-other-merges"
    shutil.copytree(zoo["k25"], changed)
    (changed / "tiktoken.model").write_text(fx.kimi_tokenizer_files(merges=(b"ab",))["tiktoken.model"])
    assert tokenizer_fingerprint(changed)["vocab_sha256"] != a["vocab_sha256"]


def test_without_tiktoken_the_kimi_tokenizer_is_a_warning(zoo, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    monkeypatch.setitem(sys.modules, "tiktoken.load", None)
    fp = tokenizer_fingerprint(zoo["k25"])
    assert fp["kind"] == "tiktoken" and "vocab_sha256" not in fp and "pip install tiktoken" in fp["note"]
    assert by_name(inspect(zoo["k25"]), "tokenizer").status == WARN


# --------------------------------------------------------------------------------------------
# Heads exported by outrider, with weights, against a tiny real target
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    target = save_tiny("llama", d / "tiny-llama", layers=8)
    cfg = Eagle3Config.for_target(load_config_dict(target), draft_vocab_size=32)
    torch.manual_seed(0)
    head = Eagle3Head(cfg)
    ids = torch.randperm(96)[:32].sort().values
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[ids] = True
    head.set_vocab(ids - torch.arange(32), t2d)
    dirs = {fmt: export(head, fmt, d / fmt, target=str(target), dtype="float32").out
            for fmt in ("vllm", "sglang", "speculators")}
    return target, dirs, d


@pytest.mark.parametrize("fmt, engines", [("vllm", {"vllm": True, "sglang": True}),
                                          ("sglang", {"vllm": True, "sglang": True}),
                                          ("speculators", {"vllm": True, "sglang": False})])
def test_exported_heads_are_servable_by_the_engines_they_are_for(tiny, fmt, engines):
    target, dirs, _ = tiny
    report = inspect(target, dirs[fmt])
    assert report.engines == engines
    for name in ("tokenizer", "weights", "d2t", "trained for", "hidden size", "vocab size"):
        assert by_name(report, name).status == PASS, by_name(report, name)
    assert by_name(report, "special tokens").status == PASS and by_name(report, "chat template").status == PASS
    parsed = json.loads(to_json(report))
    assert parsed["exit_code"] == 0 and len(parsed["checks"]) == len(report.checks)


def test_a_head_recording_its_target_as_a_path_is_trained_for_it(tiny, tmp_path):
    target, dirs, _ = tiny
    head = tmp_path / "h"
    shutil.copytree(dirs["vllm"], head)
    config = json.loads((head / "config.json").read_text())
    alias = tmp_path / "alias"  # a spec whose name differs from the folder's but resolves to it
    alias.symlink_to(target, target_is_directory=True)
    config["outrider"]["target"] = str(alias)  # the trainer records the spec it was given
    (head / "config.json").write_text(json.dumps(config))
    assert by_name(inspect(target, head), "trained for").status == PASS


def test_a_different_vocabulary_fails(tiny):
    target, dirs, d = tiny
    other = d / "tiny-llama-other-vocab"
    shutil.copytree(target, other, dirs_exist_ok=True)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["w10"], vocab["w11"] = vocab["w11"], vocab["w10"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    report = inspect(other, dirs["vllm"])
    assert by_name(report, "tokenizer").status == FAIL and report.exit_code == 1
    assert by_name(report, "trained for").status == WARN  # the head names tiny-llama


def test_an_invalid_d2t_fails(tiny, tmp_path):
    _, dirs, _ = tiny
    target = tiny[0]
    broken = tmp_path / "broken"
    shutil.copytree(dirs["vllm"], broken)
    tensors = load_file(broken / "model.safetensors")
    d2t = tensors["d2t"].clone()
    d2t[1] = d2t[0] - 1  # draft ids 0 and 1 now map to the same target id
    save_file({**tensors, "d2t": d2t}, broken / "model.safetensors")
    report = inspect(target, broken)
    assert by_name(report, "d2t").status == FAIL and "two draft ids" in by_name(report, "d2t").reason
    assert not report.servable


def test_render_prints_every_check(zoo):
    from rich.console import Console

    console = Console(record=True, width=200)
    report = inspect(zoo["k25"], zoo["head"])
    render(report, console)
    text = console.export_text()
    assert "acceptance unknown" in text and report.verdict in text
    assert text.count("pass") >= sum(c.status == PASS for c in report.checks)


def test_json_flag_means_a_file_or_stdout_as_in_every_verb(zoo, tmp_path, capsys):
    """``--json F`` writes the report to F (the table still printed); ``--json -`` prints the JSON
    alone on standard output, as ``bench`` and ``plan`` do."""
    from outrider.cli import main

    out = tmp_path / "report.json"
    code = main(["inspect", str(zoo["k25"]), "--draft", str(zoo["head"]), "--json", str(out)])
    table = capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["exit_code"] == code and "outrider inspect" in table
    assert main(["inspect", str(zoo["k25"]), "--draft", str(zoo["head"]), "--json", "-"]) == code
    assert json.loads(capsys.readouterr().out) == written


# --------------------------------------------------------------------------------------------
# MLA heads and EAGLE 3.1 options
# --------------------------------------------------------------------------------------------

def test_a_kimi_k25_mla_head_is_servable_with_its_kv_bytes(zoo, tmp_path):
    report = inspect(zoo["k25"], fx.kimi_k25_eagle3_mla_head(tmp_path / "mla"))
    assert report.servable and report.engines == {"vllm": True, "sglang": True}, report.verdict
    shapes = by_name(report, "MLA shapes")
    assert shapes.status == PASS and "latent 512 + rope 64" in shapes.reason
    kv = by_name(report, "draft KV cache")
    # the engines cache (512 + 64) x 2 B; a GQA head for K2.5 is 64 heads x 112 (H / heads), keys and values
    assert "1152 B per token" in kv.reason and "a GQA head for this target: 28672 B" in kv.reason
    assert "PR 36361" in by_name(report, "draft architecture", "vllm").reason
    assert "PR 24826" in by_name(report, "draft architecture", "sglang").reason
    assert by_name(report, "aux ids as read", "vllm").reason == "vLLM captures [2, 30, 58]"
    assert by_name(report, "aux ids as read", "sglang").reason == "SGLang captures [2, 30, 58]"
    assert by_name(report, "trained for").status == PASS


@pytest.mark.parametrize("overrides, reason", [
    ({"kv_lora_rank": 256}, "kv_lora_rank 256 != the target's 512"),
    ({"qk_rope_head_dim": 32}, "qk_rope_head_dim 32 != the target's 64"),
])
def test_a_mis_shaped_mla_head_fails_with_the_reason(zoo, tmp_path, overrides, reason):
    report = inspect(zoo["k25"], fx.kimi_k25_eagle3_mla_head(tmp_path / "mla", **overrides))
    shapes = by_name(report, "MLA shapes")
    assert shapes.status == FAIL and reason in shapes.reason and "MLA attention backend" in shapes.reason
    assert not report.servable and report.verdict.startswith("not servable: MLA shapes")


def test_a_nested_only_mla_config_follows_sglangs_deepseek_rule(zoo, tmp_path):
    """eagle_config [2, 30, 58] alone: SGLang (PR 25454) reads it unshifted on Kimi; vLLM ignores it and
    captures its default, which here is the same."""
    head = fx.kimi_k25_eagle3_mla_head(tmp_path / "mla", eagle_aux_hidden_state_layer_ids=None,
                                       eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 58]})
    report = inspect(zoo["k25"], head)
    assert report.engines == {"vllm": True, "sglang": True}
    assert "PR 25454" in by_name(report, "aux ids as read", "sglang").reason
    assert by_name(report, "aux id convention").status == WARN


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory):
    d = tmp_path_factory.mktemp("tinymla")
    target = save_tiny("deepseek_v3", d / "tiny-dsv3", layers=8)
    cfg = Eagle3Config.for_target(load_config_dict(target), draft_vocab_size=32, attention="mla", fc_norm=True)
    torch.manual_seed(0)
    head = Eagle3Head(cfg)
    export(head, "vllm", d / "mla", target=str(target), dtype="float32")
    return target, d / "mla"


def test_an_exported_mla_head_passes_and_a_broken_tensor_fails(tiny_mla, tmp_path):
    target, head = tiny_mla
    report = inspect(target, head)
    assert report.engines == {"vllm": True, "sglang": True}
    assert by_name(report, "weights").status == PASS and by_name(report, "MLA shapes").status == PASS
    broken = tmp_path / "broken"
    shutil.copytree(head, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["layers.0.self_attn.kv_b_proj.weight"] = tensors["layers.0.self_attn.kv_b_proj.weight"][:-1]
    save_file(tensors, broken / "model.safetensors")
    weights = by_name(inspect(target, broken), "weights")
    assert weights.status == FAIL and "kv_b_proj" in weights.reason


def test_options_each_engine_does_not_read_fail_for_it(tiny, tmp_path):
    target, _, _ = tiny
    cfg = Eagle3Config.for_target(load_config_dict(target), draft_vocab_size=32, norm_before_residual=True,
                                  sliding_window=16, aux_layer_ids=(2, 4, 8))
    torch.manual_seed(0)
    out = export(Eagle3Head(cfg), "vllm", tmp_path / "h", target=str(target), dtype="float32")
    assert any("SGLang does not read norm_before_residual" in n for n in out.notes)
    report = inspect(target, tmp_path / "h")
    assert by_name(report, "draft options", "vllm").status == PASS
    sglang = by_name(report, "draft options", "sglang")
    assert sglang.status == FAIL and "norm_before_residual" in sglang.reason
    # aux id 8 = the 8-layer target's last output: vLLM's Llama captures it, SGLang never does
    assert by_name(report, "aux ids as read", "vllm").status == PASS
    assert by_name(report, "aux ids as read", "sglang").status == FAIL
    assert report.engines == {"vllm": True, "sglang": False}
    launch = (tmp_path / "h/LAUNCH.md").read_text()
    assert "vllm serve" in launch and "SGLang cannot serve this head" in launch
