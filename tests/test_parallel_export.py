"""P-EAGLE heads out and back in: vllm / speculators exports carry mask_hidden and the placeholder
token, SGLang is refused, inspect tells parallel heads apart and warns when config and checkpoint
disagree, and the CLI refuses a head of the other kind in one line (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import make_head as export_head
from tiny import save_tiny

from outrider.cli import main as cli_main
from outrider.errors import UserError
from outrider.heads.eagle3 import Eagle3Head
from outrider.interop.checkpoint import load_head, read_head_spec
from outrider.interop.formats.export import export, save_head
from outrider.interop.inspect import inspect

LAYERS = 8
MASK = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("ptarget"), seed=0, layers=LAYERS)


def make_head(target_dir, parallel=True, aux_layer_ids=None, seed=1, draft_vocab=32) -> Eagle3Head:
    options = {"parallel_drafting": True, "mask_token_id": MASK} if parallel else {}
    return export_head(target_dir, draft_vocab, aux_layer_ids, seed, **options)


def placeholder_logits(head: Eagle3Head, n: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(1, n, head.config.hidden_size, generator=gen)
    with torch.no_grad():
        return head(emb, head.placeholder(1, n)[1], torch.arange(n)[None])[0]


def test_vllm_export_carries_what_vllm_reads(target_dir, tmp_path):
    """vLLM's loader (``vllm/model_executor/models/llama_eagle3.py``, ``Eagle3LlamaForCausalLM.load_weights``)
    catches the weight named ``mask_hidden`` and views it as [1, n_aux * H_t]; its proposer
    (``vllm/v1/spec_decode/llm_base_proposer.py``, ``_init_parallel_drafting_params``) reads the
    placeholder id from the draft config's ``mask_token_id`` (or ``ptd_token_id``) and refuses a
    parallel-drafting draft without one; ``parallel_drafting`` itself comes from --speculative-config."""
    head = make_head(target_dir)
    report = export(head, "vllm", tmp_path / "v", target=str(target_dir), dtype="float32")
    assert report.max_abs_logit_diff < 1e-6  # float32 rounding of the placeholder rows, as the engines see them
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert config["mask_token_id"] == MASK and config["parallel_drafting"] is True
    tensors = load_file(tmp_path / "v" / "model.safetensors")
    assert tuple(tensors["mask_hidden"].shape) == (1, 3 * head.config.target_hidden_size)
    assert torch.equal(tensors["mask_hidden"], head.mask_hidden.detach())
    launch = (tmp_path / "v" / "LAUNCH.md").read_text()
    assert '"parallel_drafting": true' in launch and "SGLang serves no P-EAGLE" in launch
    loaded, cfg = load_head(tmp_path / "v", target_dir)
    assert cfg == head.config and cfg.parallel_drafting and cfg.mask_token_id == MASK
    torch.testing.assert_close(placeholder_logits(loaded), placeholder_logits(head), rtol=0, atol=1e-6)
    save_head(loaded, tmp_path / "ours", target=str(target_dir))
    assert load_head(tmp_path / "ours", target_dir)[1] == head.config


def test_eagle3_exports_are_unchanged(target_dir, tmp_path):
    export(make_head(target_dir, parallel=False), "vllm", tmp_path / "e", target=str(target_dir), dtype="float32")
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    assert "mask_token_id" not in config and "parallel_drafting" not in config
    assert "mask_hidden" not in load_file(tmp_path / "e" / "model.safetensors")
    assert "parallel_drafting" not in (tmp_path / "e" / "LAUNCH.md").read_text()


def test_unsorted_aux_ids_permute_mask_hidden_with_fc(target_dir, tmp_path):
    head = make_head(target_dir, aux_layer_ids=(5, 2, 4))
    report = export(head, "vllm", tmp_path / "u", target=str(target_dir), dtype="float32")
    assert report.written_aux_layer_ids == [2, 4, 5] and report.max_abs_logit_diff < 1e-5
    loaded, _ = load_head(tmp_path / "u", target_dir)
    torch.testing.assert_close(placeholder_logits(loaded), placeholder_logits(head), rtol=0, atol=1e-5)


def test_bf16_export_check_covers_mask_hidden(target_dir, tmp_path, monkeypatch):
    head = make_head(target_dir)
    assert export(head, "vllm", tmp_path / "b", target=str(target_dir)).max_abs_logit_diff < 1e-2
    from outrider.interop import checkpoint

    real = checkpoint.to_format_state_dict

    def zeroed(h, fmt, dtype):  # a writer that dropped mask_hidden's values
        out = real(h, fmt, dtype)
        out["mask_hidden"] = torch.zeros_like(out["mask_hidden"])
        return out

    monkeypatch.setattr("outrider.interop.formats.export.to_format_state_dict", zeroed)
    with pytest.raises(UserError, match="does not reproduce the head"):
        export(head, "vllm", tmp_path / "z", target=str(target_dir), dtype="float32")


def test_sglang_is_refused_in_one_line(target_dir, tmp_path):
    with pytest.raises(UserError, match="SGLang serves no P-EAGLE.*--format vllm or --format speculators"):
        export(make_head(target_dir), "sglang", tmp_path / "s", target=str(target_dir))
    assert not (tmp_path / "s").exists()


def test_speculators_export_is_a_peagle_speculator(target_dir, tmp_path):
    head = make_head(target_dir)
    path = tmp_path / "spec"
    export(head, "speculators", path, target=str(target_dir), dtype="float32")
    config = json.loads((path / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == MASK
    assert config["architectures"] == ["PEagleSpeculator"]
    tensors = load_file(path / "model.safetensors")
    assert tuple(tensors["mask_hidden"].shape) == (1, 1, 3 * head.config.target_hidden_size)
    loaded, cfg = load_head(path, target_dir)
    assert cfg.parallel_drafting and cfg.mask_token_id == MASK
    torch.testing.assert_close(placeholder_logits(loaded), placeholder_logits(head), rtol=0, atol=1e-6)


def test_speculators_peagle_class_loads_our_export(target_dir, tmp_path):
    try:
        peagle = __import__("speculators.models.peagle", fromlist=["_"])
    except ImportError as e:
        pytest.skip(f"speculators is not installed ({e})")
    head = make_head(target_dir)
    path = tmp_path / "spec"
    export(head, "speculators", path, target=str(target_dir), dtype="float32")
    config = peagle.PEagleSpeculatorConfig.from_pretrained(path)
    assert config.mask_token_id == MASK
    config.transformer_layer_config._attn_implementation = "eager"
    peer = peagle.PEagleDraftModel.from_pretrained(path, config=config, dtype=torch.float32).eval()
    ours, theirs = set(load_file(path / "model.safetensors")), set(peer.state_dict())
    assert ours - theirs == set()
    assert theirs - ours - set(peer._keys_to_ignore_on_load_missing) == set()
    assert torch.equal(peer.mask_hidden.detach().reshape(1, -1), head.mask_hidden.detach())
    assert peer.mask_token_id == MASK


def _patched(src, dst, config=None, drop=(), add=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    for key in [k for k, v in (config or {}).items() if v is None]:
        del cfg[key]
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items() if k not in drop}
    tensors.update(add or {})
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_config_and_checkpoint_disagreements(target_dir, tmp_path):
    head = make_head(target_dir)
    good = tmp_path / "good"
    export(head, "vllm", good, target=str(target_dir), dtype="float32")
    no_mask = _patched(good, tmp_path / "no_mask", drop=("mask_hidden",))
    with pytest.raises(UserError, match="no mask_hidden"):
        load_head(no_mask, target_dir)
    # a plain vLLM P-EAGLE folder: mask_token_id and mask_hidden, no parallel_drafting key
    plain = _patched(good, tmp_path / "plain", {"parallel_drafting": None})
    assert load_head(plain, target_dir)[1].parallel_drafting
    # mask_hidden without mask_token_id: vLLM skips it; so does outrider (an EAGLE-3 head), inspect warns
    orphan = _patched(good, tmp_path / "orphan", {"parallel_drafting": None, "mask_token_id": None})
    assert not load_head(orphan, target_dir)[1].parallel_drafting
    checks = {c.name: c for c in inspect(target_dir, orphan).checks}
    assert checks["parallel drafting"].status == "warn" and "no mask_token_id" in checks["parallel drafting"].reason
    no_token = _patched(good, tmp_path / "no_token", {"mask_token_id": None})
    report = inspect(target_dir, no_token)
    assert any(c.name == "parallel drafting" and c.status == "fail" for c in report.checks)
    report = inspect(target_dir, no_mask)
    assert any(c.name == "parallel drafting" and c.status == "fail" and "no mask_hidden" in c.reason
               for c in report.checks)


def test_inspect_recognises_a_parallel_head(target_dir, tmp_path):
    export(make_head(target_dir), "vllm", tmp_path / "v", target=str(target_dir), dtype="float32")
    report = inspect(target_dir, tmp_path / "v")
    assert "P-EAGLE" in next(c for c in report.checks if c.name == "draft").reason
    par = [c for c in report.checks if c.name == "parallel drafting"]
    assert any(c.status == "pass" and '"parallel_drafting": true' in c.reason for c in par)
    assert report.engines == {"vllm": True, "sglang": False}
    assert read_head_spec(tmp_path / "v").to_dict()["mask_token_id"] == MASK


@pytest.fixture(scope="module")
def heads(target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("pheads")
    for name, parallel in (("parallel", True), ("eagle3", False)):
        save_head(make_head(target_dir, parallel=parallel), root / name, target=str(target_dir))
    no_mask = _patched(root / "parallel", root / "no_mask", drop=("mask_hidden",))
    return {"parallel": root / "parallel", "eagle3": root / "eagle3", "no_mask": no_mask}


@pytest.mark.parametrize("verb", ["bench", "generate"])
@pytest.mark.parametrize("method, head, message", [
    ("eagle3", "parallel", "is a parallel-drafting (P-EAGLE) head"),
    ("parallel", "eagle3", "--method parallel needs a parallel-drafting head"),
    ("parallel", "no_mask", "no mask_hidden"),
])
def test_cli_refuses_a_head_of_the_other_kind(target_dir, heads, tmp_path, capsys, verb, method, head, message):
    args = ["--prompts", str(_prompts(tmp_path)), "--num-prompts", "1"] if verb == "bench" else ["--prompt", "w5 w6"]
    rc = cli_main([verb, str(target_dir), "--method", method, "--draft", str(heads[head]), "--max-new-tokens", "4",
                   *args])
    # the target loads first: transformers' own progress bar may precede the one line
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("Loading weights")]
    assert rc == 2 and len(err) == 1 and message in err[0], err


def test_cli_serves_a_parallel_head_losslessly(target_dir, heads, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli_main(["bench", str(target_dir), "--method", "parallel", "--draft", str(heads["parallel"]), "--k", "3",
                   "--prompts", str(_prompts(tmp_path)), "--num-prompts", "1", "--max-new-tokens", "8",
                   "--json", str(out)])
    assert rc in (0, None)
    record = json.loads(out.read_text())
    record = record[0] if isinstance(record, list) else record
    assert record["method"] == "parallel" and record["verdict"] == "exact"


def _prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("w5 w6 w7 w5 w6 w7\n")
    return path


def test_train_flag_is_documented():
    from outrider.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "verb" or getattr(a, "choices", None))
    text = sub.choices["train"].format_help()
    assert "--parallel-drafting" in text and "mask_token_id" in text
