"""``outrider inspect``: can this target (and this draft) be served speculatively, and how?

Contract:
- ``inspect(target, draft=None) -> InspectReport``: a list of checks, each ``pass``/``warn``/``fail``
  with a one-line reason, and a verdict. With a draft: tokenizer identity, vocabulary, hidden
  size, aux layer ids under each engine's reading, draft vocabulary and ``d2t``, the draft and
  target architectures vLLM and SGLang accept, MLA/MoE, max positions, dtype and quantisation,
  and whether the head was trained for this target. Without one: which speculative methods the
  target can use (MTP layers, EAGLE-3 support, n-gram, draft model) and a recommendation.
- Works on config-only folders (config.json and tokenizer files, no weights); checks that need
  weights say so. Kimi's ``kimi_k25`` wrapper is read through its ``text_config``; its tiktoken
  tokenizer (``tiktoken.model``, no ``tokenizer.json``) is fingerprinted when ``tiktoken`` is
  installed, otherwise tokenizer identity is a warning.
- Exit codes for the CLI (``InspectReport.exit_code``): 0 when the pair can be served by at least
  one engine (or, without a draft, when some method is available), 1 when not. Bad input raises
  ``UserError`` (exit 2): a missing or unreadable config or weights file, aux ids beyond the
  target's layers, a draft vocabulary larger than the target's.

Not done here: downloading anything, loading model weights (only the head's small tensors
``d2t``/``t2d`` are read, and tensor shapes from safetensors headers), measuring acceptance
(``outrider bench`` does). Engine facts (``engines``) are cited by PR; a newer engine may accept
more.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from outrider.errors import UserError
from outrider.interop.checkpoint import HeadSpec, read_config, read_head_spec
from outrider.interop.formats.dflash import dflash_issues, is_dflash, read_dflash
from outrider.interop.engines import CHECKED_ON, installed_version
from outrider.interop.draft_checks import (
    FAIL,
    PASS,
    WARN,
    Check,
    architecture_checks,
    attention_checks,
    aux_checks,
    option_checks,
    parallel_checks,
    weights_checks,
)
from outrider.models import (
    ArchInfo,
    arch_info,
    load_config_dict,
    resolve,
    target_name,
    tokenizer_fingerprint,
)

__all__ = ["FAIL", "PASS", "WARN", "Check", "InspectReport", "inspect", "render", "to_json"]

# Target model types whose EAGLE-3 aux capture each engine implements. vLLM: the
# ``eagle3_target_supported`` list in ``vllm/config/speculative.py`` (llama, qwen, minicpm, gpt_oss,
# hunyuan, afmoe); DeepSeek-V3 and Kimi-K2.x joined in 2026 releases (vLLM PRs 31257/32079; the
# published Kimi-K2.6 EAGLE-3 drafts are served with vLLM 0.20). SGLang: ``set_eagle3_layers_to_capture``
# in its llama, qwen2/3(-MoE) and deepseek_v2 models (DeepSeek-like since SGLang PR 12319).
_VLLM_EAGLE3 = ("llama", "qwen", "minicpm", "gpt_oss", "hunyuan", "afmoe")
_VLLM_EAGLE3_RECENT = ("deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25")
_SGLANG_EAGLE3 = ("llama", "qwen", "deepseek_v3", "deepseek_v2", "kimi_k2", "kimi_k25", "gpt_oss")


@dataclass
class InspectReport:
    target: str
    draft: str | None
    checks: list[Check]
    servable: bool
    verdict: str
    engines: dict[str, bool] = field(default_factory=dict)  # with a draft: which engine can serve it
    recommendation: str | None = None
    target_info: dict[str, Any] = field(default_factory=dict)
    draft_info: dict[str, Any] | None = None

    @property
    def exit_code(self) -> int:
        return 0 if self.servable else 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["exit_code"] = self.exit_code
        return d


def to_json(report: InspectReport) -> str:
    return json.dumps(report.to_dict(), indent=2)


def render(report: InspectReport, console) -> None:
    """Print the checks as a table, then the verdict (``console`` is a ``rich.console.Console``)."""
    from rich.table import Table

    title = f"outrider inspect: {report.target}" + (f"  +  draft {report.draft}" if report.draft else "")
    table = Table(title=title, show_lines=False)
    table.add_column("check")
    table.add_column("status")
    table.add_column("reason", overflow="fold")
    style = {PASS: "green", WARN: "yellow", FAIL: "red"}
    for c in report.checks:
        name = c.name + (f" [{c.engine}]" if c.engine else "")
        table.add_row(name, f"[{style[c.status]}]{c.status}[/]", c.reason)
    console.print(table)
    console.print(f"[bold {'green' if report.servable else 'red'}]{report.verdict}[/]")
    if report.recommendation:
        console.print(f"recommendation: {report.recommendation}")


# --------------------------------------------------------------------------------------------
# Names and tokenizer fingerprints
# --------------------------------------------------------------------------------------------

def _same_model(a: str, b: str) -> bool:
    return a.rstrip("/").rsplit("/", 1)[-1].lower() == b.rstrip("/").rsplit("/", 1)[-1].lower()


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------

def _model_types(cfg: dict[str, Any], info: ArchInfo) -> tuple[str, ...]:
    return tuple(t for t in (str(cfg.get("model_type") or ""), info.model_type) if t)


def _engine_support(types: tuple[str, ...]) -> list[Check]:
    checks = []
    if any(s in t for t in types for s in _VLLM_EAGLE3):
        checks.append(Check("target EAGLE-3 support", PASS, f"vLLM captures aux states for model_type {types[-1]}",
                            "vllm"))
    elif any(t in _VLLM_EAGLE3_RECENT for t in types):
        checks.append(Check("target EAGLE-3 support", WARN, f"model_type {types[-1]}: needs a 2026 vLLM release "
                            f"(served by vLLM {CHECKED_ON['vllm'][0]}; older ones reject it in eagle3_target_supported)", "vllm"))
    else:
        checks.append(Check("target EAGLE-3 support", WARN, f"model_type {'/'.join(types)} is not known to capture "
                            "EAGLE-3 aux states in vLLM", "vllm"))
    if any(s in t for t in types for s in _SGLANG_EAGLE3):
        checks.append(Check("target EAGLE-3 support", PASS, f"SGLang captures aux states for model_type {types[-1]}",
                            "sglang"))
    else:
        checks.append(Check("target EAGLE-3 support", WARN, f"model_type {'/'.join(types)} is not known to capture "
                            "EAGLE-3 aux states in SGLang", "sglang"))
    return checks


def _engine_version_checks() -> list[Check]:
    """The vLLM installed in this Python, against the version the engine facts were checked on."""
    checked, how = CHECKED_ON["vllm"]
    here = installed_version("vllm")
    if here is None:
        return [Check("vLLM version", PASS, f"no vLLM in this Python; the vLLM checks hold for vLLM {checked} ({how})",
                      "vllm")]
    same = here.split("+")[0] == checked
    return [Check("vLLM version", PASS if same else WARN, f"vLLM {here} installed here; the vLLM checks hold for vLLM "
                  f"{checked}" + ("" if same else ": another release may read drafts differently"), "vllm")]


def _attention_checks(info: ArchInfo) -> list[Check]:
    checks = []
    if info.attention == "MLA":
        checks.append(Check("attention", WARN, f"MLA target (kv_lora_rank {info.kv_lora_rank}): the EAGLE-3 draft is "
                            "a GQA Llama layer; give it its own attention backend, e.g. "
                            "\"attention_backend\": \"FLASH_ATTN\" in --speculative-config (vLLM PR 39930)", "vllm"))
    else:
        checks.append(Check("attention", PASS,
                            f"{info.attention}, {info.num_heads} heads, {info.num_kv_heads} kv heads"))
    if info.is_moe:
        checks.append(Check("MoE", PASS, f"{info.num_experts} routed experts, {info.experts_per_token} per token, "
                            f"{info.num_moe_layers} MoE layers: every verified token wakes more experts, so draft "
                            f"chains (top-k 1) of few tokens"))
    else:
        checks.append(Check("MoE", PASS, "dense model"))
    return checks


def _tokenizer_checks(target_fp: dict[str, Any], draft_fp: dict[str, Any] | None, source: str) -> list[Check]:
    if target_fp.get("note") and not target_fp.get("vocab_sha256"):
        return [Check("tokenizer", WARN, f"target tokenizer ({target_fp.get('kind') or 'none'}): {target_fp['note']}; "
                      "identity not checked, vocabulary sizes compared below")]
    if not draft_fp or not draft_fp.get("vocab_sha256"):
        return [Check("tokenizer", WARN, "the draft carries no tokenizer and no tokenizer fingerprint: identity not "
                      "checked, vocabulary sizes compared below")]
    checks = []
    if draft_fp["vocab_sha256"] == target_fp["vocab_sha256"]:
        checks.append(Check("tokenizer", PASS, f"same vocabulary ({target_fp.get('kind')}, sha256 "
                            f"{target_fp['vocab_sha256'][:12]}; draft side from {source})"))
    else:
        checks.append(Check("tokenizer", FAIL, f"vocabularies differ (target {target_fp['vocab_sha256'][:12]}, "
                            f"draft {draft_fp['vocab_sha256'][:12]} from {source}): the draft predicts another "
                            f"tokenizer's ids"))
    if draft_fp.get("specials_sha256") and target_fp.get("specials_sha256"):
        same = draft_fp["specials_sha256"] == target_fp["specials_sha256"]
        checks.append(Check("special tokens", PASS if same else WARN, "same special tokens" if same else
                            "special tokens differ: turn boundaries may be drafted badly"))
    if draft_fp.get("chat_template_sha256") and target_fp.get("chat_template_sha256"):
        same = draft_fp["chat_template_sha256"] == target_fp["chat_template_sha256"]
        checks.append(Check("chat template", PASS if same else WARN, "same chat template" if same else
                            "chat templates differ: the draft was trained on conversations rendered another way, "
                            "acceptance may drop"))
    return checks


def _same_folder(spec: str, path: Path) -> bool:
    """Whether a recorded target spec (``default``, a local path) resolves to this target's folder."""
    try:
        return resolve(spec).resolve() == path.resolve()
    except (UserError, OSError):
        return False


def _trained_for_check(spec: HeadSpec, name: str, path: Path) -> Check:
    if spec.trained_for is None:
        return Check("trained for", WARN, "acceptance unknown: the draft does not say which target it was trained for")
    if _same_model(spec.trained_for, name) or _same_folder(spec.trained_for, path):
        return Check("trained for", PASS, f"trained for this target ({spec.trained_for})")
    return Check("trained for", WARN, f"acceptance unknown: trained for {spec.trained_for}, this target is {name} "
                 f"(measure it with outrider bench)")


def _dtype_checks(info: ArchInfo, spec: HeadSpec | None) -> list[Check]:
    target = f"target {info.dtype or 'dtype unstated'}"
    if info.quantization:
        target += f", quantised ({info.quantization})"
    if spec is None:
        return [Check("dtype", PASS, target)]
    if spec.quantization:
        return [Check("dtype", WARN, f"{target}; the draft is quantised ({spec.quantization}): check your engine "
                      f"supports a quantised EAGLE-3 head")]
    return [Check("dtype", PASS, f"{target}; draft {spec.torch_dtype or 'dtype unstated'}, unquantised")]


def _method_checks(cfg: dict[str, Any], info: ArchInfo, types: tuple[str, ...]) -> tuple[list[Check], str]:
    checks = []
    if info.num_mtp_layers:
        checks.append(Check("method: mtp", PASS, f"{info.num_mtp_layers} MTP layer(s) in the checkpoint: vLLM "
                            "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'; SGLang "
                            "--speculative-algorithm EAGLE (the target's NextN layer is the draft)"))
    else:
        checks.append(Check("method: mtp", FAIL, "no MTP layers (num_nextn_predict_layers is 0 or absent)"))
    eagle = _engine_support(types)
    supported = [c for c in eagle if c.status == PASS]
    if supported:
        engines = " and ".join("vLLM" if c.engine == "vllm" else "SGLang" for c in supported)
        caveats = "".join(f" ({c.reason})" for c in eagle if c.status != PASS)
        checks.append(Check("method: eagle3", PASS, f"{engines} {'capture' if len(supported) > 1 else 'captures'} aux "
                            f"states for this target{caveats}: train a head (outrider train) or check a published one "
                            f"with --draft"))
    else:
        checks.append(Check("method: eagle3", WARN, eagle[0].reason + "; a recent engine release may add it"))
    checks.append(Check("method: ngram", PASS, "no extra weights; pays off only on repetitive output (code edits, "
                        "quoting), rarely on reasoning"))
    checks.append(Check("method: draft_model", WARN, "needs a smaller model that shares this tokenizer; "
                        "not checked here"))
    if info.num_mtp_layers:
        rec = "mtp: the target ships its own MTP layer(s); nothing to train"
    elif supported:
        rec = "eagle3: train a head with outrider train (or find a published one), then chains of ~3 draft tokens"
    else:
        rec = "ngram, until your engine supports EAGLE-3 for this target"
    if info.is_moe and not info.num_mtp_layers:
        rec += "; MoE: keep top-k 1 (a chain beats a tree of the same size)"
    return checks, rec


def _load_target(target: str | Path) -> tuple[Path, dict[str, Any], ArchInfo]:
    path = resolve(target)
    cfg = load_config_dict(target)
    return path, cfg, arch_info(cfg)


def inspect(target: str | Path, draft: str | Path | None = None) -> InspectReport:
    """Check a target, and optionally an EAGLE-3 draft against it; see the module docstring."""
    path, cfg, info = _load_target(target)
    name = target_name(path, cfg)
    types = _model_types(cfg, info)
    if path.is_dir():
        fp = tokenizer_fingerprint(path)
    else:
        fp = {"kind": "gguf", "note": "GGUF target: the tokenizer inside the GGUF is not fingerprinted"}
    archs = ", ".join(info.architectures) or "no architectures"
    checks = [Check("target", PASS, f"{name}: {'/'.join(types)} ({archs}), {info.num_layers} layers, "
                    f"hidden {info.hidden_size}, vocab {info.vocab_size}")]
    if draft is None:
        tok = (f"{fp['kind']}, {fp.get('vocab_size', '?')} tokens" if fp.get("vocab_sha256")
               else f"{fp.get('kind') or 'none'}: {fp.get('note', '')}")
        checks.append(Check("tokenizer", PASS if fp.get("vocab_sha256") else WARN, tok))
        checks += _attention_checks(info)
        checks += _dtype_checks(info, None)
        checks += _engine_version_checks()
        methods, rec = _method_checks(cfg, info, types)
        checks += methods
        usable = [c.name.removeprefix("method: ") for c in methods if c.status == PASS]
        verdict = f"usable methods: {', '.join(usable)}" if usable else "no speculative method is usable"
        return InspectReport(target=str(target), draft=None, checks=checks, servable=bool(usable), verdict=verdict,
                             recommendation=rec, target_info=info.to_dict())

    draft_path = Path(draft).expanduser()
    if (draft_path / "config.json").is_file() and is_dflash(read_config(draft_path)):
        dflash, draft_info = _dflash_checks(draft_path, cfg, info, fp, types)
        return _verdict(target, draft, checks + dflash, info, draft_info)
    spec = read_head_spec(draft_path)
    hcfg = spec.config
    if hcfg.draft_vocab_size > info.vocab_size:
        raise UserError(f"the draft vocabulary ({hcfg.draft_vocab_size}) is larger than the target's vocabulary "
                        f"({info.vocab_size}): this draft was made for another tokenizer")
    if hcfg.draft_vocab_size > hcfg.vocab_size:
        raise UserError(f"the draft's config is inconsistent: draft_vocab_size {hcfg.draft_vocab_size} > vocab_size "
                        f"{hcfg.vocab_size}")
    origin = {"outrider": "outrider", "speculators": "speculators", "eagle3": "SpecForge/SGLang-style"}[spec.source]
    kind = (f"MLA ({hcfg.num_attention_heads} heads, q_lora {spec.mla['q_lora_rank']}, kv_lora "
            f"{spec.mla['kv_lora_rank']}, rope {spec.mla['qk_rope_head_dim']})" if hcfg.attention == "mla"
            else f"{hcfg.num_attention_heads} heads x {hcfg.head_dim}")
    what = "P-EAGLE (parallel-drafting)" if hcfg.parallel_drafting else "EAGLE-3"
    checks.append(Check("draft", PASS, f"{origin} {what} head: hidden {hcfg.hidden_size}, {kind}, draft vocab "
                        f"{hcfg.draft_vocab_size}"))
    draft_fp, source = None, ""
    if any((draft_path / n).exists() for n in ("tokenizer.json", "tiktoken.model", "tokenizer_config.json")):
        draft_fp, source = tokenizer_fingerprint(draft_path), "its tokenizer files"
    elif spec.target_record.get("tokenizer"):
        draft_fp, source = spec.target_record["tokenizer"], "the fingerprint recorded at export"
    checks += _tokenizer_checks(fp, draft_fp, source)
    if hcfg.vocab_size == info.vocab_size:
        checks.append(Check("vocab size", PASS, f"{info.vocab_size} in both"))
    else:
        checks.append(Check("vocab size", FAIL, f"the draft was built for a vocabulary of {hcfg.vocab_size}, the "
                            f"target has {info.vocab_size}"))
    checks.append(Check("draft vocabulary", PASS, f"{hcfg.draft_vocab_size} of {info.vocab_size} target tokens "
                        f"({100 * hcfg.draft_vocab_size / info.vocab_size:.0f}%)"))
    if hcfg.target_hidden_size == info.hidden_size:
        checks.append(Check("hidden size", PASS, f"fc takes 3 x {info.hidden_size}, the target's width"))
    else:
        checks.append(Check("hidden size", FAIL, f"the draft expects target hidden size {hcfg.target_hidden_size}, the "
                            f"target has {info.hidden_size}"))
    if hcfg.hidden_size != info.hidden_size:
        checks.append(Check("embedding width", FAIL, f"the draft's hidden size {hcfg.hidden_size} differs from the "
                            f"target's {info.hidden_size}, whose embedding it reuses"))
    checks += aux_checks(spec, info)
    checks += weights_checks(draft_path, spec, info)
    checks += parallel_checks(draft_path, spec)
    checks += architecture_checks(spec)
    checks += option_checks(spec)
    checks += _engine_support(types)
    checks += _engine_version_checks()
    checks += attention_checks(spec, info)
    if not hcfg.max_position_embeddings or not info.max_position_embeddings:
        checks.append(Check("max positions", WARN, "max_position_embeddings missing on one side"))
    elif hcfg.max_position_embeddings >= info.max_position_embeddings:
        checks.append(Check("max positions", PASS, f"draft {hcfg.max_position_embeddings} >= target "
                            f"{info.max_position_embeddings}"))
    else:
        checks.append(Check("max positions", WARN, f"draft {hcfg.max_position_embeddings} < target "
                            f"{info.max_position_embeddings}: beyond that the draft runs outside its trained range"))
    checks += _dtype_checks(info, spec)
    checks.append(_trained_for_check(spec, name, path))
    if spec.unsupported:
        checks.append(Check("outrider support", WARN, f"outrider cannot run this head ({', '.join(spec.unsupported)}); "
                            "the engines may still serve it"))
    return _verdict(target, draft, checks, info, spec.to_dict())


def _verdict(target: str | Path, draft: str | Path, checks: list[Check], info: ArchInfo,
             draft_info: dict[str, Any]) -> InspectReport:
    """The report of a draft's checks: which engines can serve it, and the first reason none can."""
    engines = {e: not any(c.status == FAIL and c.engine in (None, e) for c in checks) for e in ("vllm", "sglang")}
    ok = [("vLLM" if e == "vllm" else "SGLang") for e, v in engines.items() if v]
    warned = any(c.status == WARN for c in checks)
    if ok:
        verdict = f"servable by {' and '.join(ok)}" + (" (see warnings)" if warned else "")
    else:
        first = next(c for c in checks if c.status == FAIL)
        verdict = f"not servable: {first.name}: {first.reason}"
    return InspectReport(target=str(target), draft=str(draft), checks=checks, servable=bool(ok), verdict=verdict,
                         engines=engines, target_info=info.to_dict(), draft_info=draft_info)


def _dflash_checks(path: Path, target_cfg: dict[str, Any], info: ArchInfo, fp: dict[str, Any],
                   types: tuple[str, ...]) -> tuple[list[Check], dict[str, Any]]:
    """A DFlash drafter against the target: its shape, the fit (``formats.dflash.dflash_issues``), the
    tensors (read back in full), the engines' support and versions; and the drafter's config."""
    try:
        drafter = read_dflash(path)
    except UserError as e:
        return [Check("draft", FAIL, f"DFlash drafter: {e}")], read_config(path)
    c = drafter.config
    checks = [Check("draft", PASS, f"DFlash block drafter: hidden {c.hidden_size}, {c.num_hidden_layers} layers of "
                    f"{c.num_attention_heads} heads x {c.head_dim}, block {c.block_size} (k up to {c.max_draft}), "
                    f"mask token {c.mask_token_id}, draft vocab {c.draft_vocab_size}")]
    if any((path / n).exists() for n in ("tokenizer.json", "tiktoken.model", "tokenizer_config.json")):
        checks += _tokenizer_checks(fp, tokenizer_fingerprint(path), "its tokenizer files")
    problems = dflash_issues(c, target_cfg)
    checks += [Check("fit", FAIL, p) for p in problems]
    if not problems:
        checks.append(Check("fit", PASS, f"reads the outputs of layers {c.target_layer_ids} of {info.num_layers} "
                            f"(outrider aux ids {list(c.aux_layer_ids)}); width and vocabulary the target's"))
    checks += [replace(ch, name="target aux-state support") for ch in _engine_support(types)]  # DFlash reads them too
    checks.append(Check("SGLang lm_head", FAIL, "SGLang's DFlash model drafts through the target's lm_head and "
                        "ignores this drafter's own lm_head and d2t", engine="sglang"))
    return checks + _engine_version_checks(), c.to_dict()
