"""``inspect``'s checks of an EAGLE-3 draft against a target: what each engine will do with it.

Contract: each function takes a ``HeadSpec`` (the draft's config, ``outrider.interop.checkpoint``)
and the target's ``ArchInfo`` and returns ``Check`` rows (``pass``/``warn``/``fail``, one-line
reason, the engine it concerns or None for both): the aux layers each engine will capture
(``aux_checks``), the draft architectures they load (``architecture_checks``), the attention
(``attention_checks``: MLA sizes against the target's, KV cache bytes per token next to the
other kind's), EAGLE 3.1 options and sliding windows (``option_checks``) and the weights'
names and shapes against the config (``weights_checks``). Engine facts come from
``outrider.interop.engines``.

Not done here: target-only checks, tokenizers, the verdict (``outrider.interop.inspect``); loading
weights beyond ``d2t``/``t2d`` and a scan for NaN/Inf (shapes come from the safetensors headers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outrider.errors import UserError
from outrider.interop.checkpoint import HeadSpec, expected_shapes, weight_source
from outrider.heads.eagle3 import Eagle3Config
from outrider.interop.engines import (
    DRAFT_ARCH,
    MLA_DRAFT_ARCH,
    MLA_DRAFT_ARCHS,
    MLA_SERVED_BY,
    SGLANG_DRAFT_ARCHS,
    SPECULATORS_ARCH,
    VLLM_DRAFT_ARCHS,
    first_id_rule,
    kv_bytes_per_token,
    option_issues,
    serves_last_layer,
)
from outrider.models import ArchInfo
from outrider.values import nonfinite

PASS, WARN, FAIL = "pass", "warn", "fail"
LABEL = {"vllm": "vLLM", "sglang": "SGLang"}
_DROPPED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
_LEGACY = {"aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.", "aux_norm_high.": "fc_norm.2."}


@dataclass
class Check:
    name: str
    status: str  # "pass" | "warn" | "fail"
    reason: str
    engine: str | None = None  # None: both engines; "vllm" | "sglang": only that one


def aux_checks(spec: HeadSpec, info: ArchInfo) -> list[Check]:
    """The ids the draft was made for, and the layers vLLM and SGLang will capture for it."""
    L, model_type = info.num_layers, info.model_type
    intended = spec.intended_aux_ids(L, model_type)
    vllm, sglang = spec.vllm_reads(L), spec.sglang_reads(L, model_type)
    for name, ids in (("trained", intended), ("vLLM", vllm), ("SGLang", sglang)):
        bad = [j for j in (ids or ()) if not 0 <= j <= L]
        if bad:
            raise UserError(f"the draft's aux layer ids ({name} reading {list(ids)}) include {bad}, beyond the "
                            f"target's {L} layers (ids 0..{L}): this draft was made for a deeper model")
    checks = []
    if intended is not None and len(set(intended)) != len(intended):
        checks.append(Check("aux layer ids", FAIL, f"{list(intended)} repeat a layer: the engines capture each layer "
                            f"once and would hand the head fewer than {len(intended)} states"))
    elif intended is not None and list(intended) != sorted(intended):
        checks.append(Check("aux layer ids", WARN, f"{list(intended)} are not ascending: the engines hand the states "
                            f"in layer order; a head trained in the listed order sees them permuted (outrider export "
                            f"rewrites the order)"))
    if spec.aux_layer_ids is None and not spec.written_eagle:
        checks.append(Check("aux layer ids", WARN, f"the draft names none ({spec.aux_ids_note}); layers trained on are "
                            f"unknown, both engines capture {list(vllm)}"))
    else:
        checks.append(Check("aux layer ids", PASS, f"{list(intended)} within 0..{L} ({spec.aux_ids_note})"))
    for engine, reads in (("vllm", vllm), ("sglang", sglang)):
        if engine == "sglang" and spec.source == "speculators":
            continue
        label = LABEL[engine]
        if L in reads and not serves_last_layer(engine, model_type):
            checks.append(Check("aux ids as read", FAIL, f"{label} cannot capture id {L} (the last layer's output) "
                                f"of a {model_type} target", engine))
            continue
        older = ""
        if engine == "sglang" and first_id_rule(model_type) and spec.written_eagle and spec.written_eagle[0] != 1:
            older = f" (SGLang before PR 25454 would capture {[j + 1 for j in spec.written_eagle]}: use a current one)"
        if tuple(reads) == tuple(intended):
            checks.append(Check("aux ids as read", PASS, f"{label} captures {list(reads)}{older}", engine))
        else:
            fix = "--format vllm" if engine == "vllm" else "--format sglang"
            checks.append(Check("aux ids as read", FAIL, f"{label} would capture {list(reads)}, the head was trained "
                                f"on {list(intended)}: re-export with outrider export {fix}", engine))
    if spec.source == "eagle3" and spec.written_eagle and spec.written_top is None:
        checks.append(Check("aux id convention", WARN, f"ids only in eagle_config {list(spec.written_eagle)}: SGLang "
                            f"reads them (+1 by its rule for {model_type or 'the target'}), vLLM ignores them and uses "
                            f"{list(vllm)}"))
    return checks


def architecture_checks(spec: HeadSpec) -> list[Check]:
    hcfg = spec.config
    archs = spec.architectures or ((SPECULATORS_ARCH,) if spec.source == "speculators" else ())
    mla = hcfg.attention == "mla"
    served = f" ({MLA_SERVED_BY})" if mla else ""
    checks = []
    if spec.source == "speculators" or any(a in VLLM_DRAFT_ARCHS for a in archs):
        checks.append(Check("draft architecture", PASS, f"vLLM loads {list(archs)}{served}", "vllm"))
    else:
        checks.append(Check("draft architecture", FAIL, f"vLLM does not load architectures {list(archs)} as an EAGLE-3 "
                            f"draft: re-export with outrider export --format vllm", "vllm"))
    if spec.source != "speculators" and any(a in SGLANG_DRAFT_ARCHS for a in archs):
        checks.append(Check("draft architecture", PASS, f"SGLang loads {list(archs)}{served}", "sglang"))
    else:
        want = MLA_DRAFT_ARCH if mla or any(a in MLA_DRAFT_ARCHS for a in archs) else DRAFT_ARCH
        why = "a speculators checkpoint" if spec.source == "speculators" else f"architectures {list(archs)}"
        checks.append(Check("draft architecture", FAIL, f"SGLang expects {want}, this is {why}: re-export with "
                            f"outrider export --format sglang", "sglang"))
    return checks


def _config_of(spec: HeadSpec, info: ArchInfo) -> Eagle3Config | None:
    try:
        return spec.eagle3_config(info.num_layers, info.model_type)
    except UserError:
        return None


def _other_kind(spec: HeadSpec, info: ArchInfo) -> dict[str, int] | None:
    """KV bytes of a head of the other attention kind for this target (None if one cannot be sized)."""
    hcfg = spec.config
    target = {"model_type": info.model_type, "hidden_size": info.hidden_size, "num_attention_heads": info.num_heads,
              "num_key_value_heads": info.num_kv_heads, "head_dim": info.head_dim, "num_hidden_layers": info.num_layers,
              "vocab_size": info.vocab_size, "intermediate_size": info.intermediate_size,
              "max_position_embeddings": info.max_position_embeddings, "kv_lora_rank": info.kv_lora_rank,
              "q_lora_rank": info.q_lora_rank, "qk_rope_head_dim": info.qk_rope_head_dim,
              "qk_nope_head_dim": info.qk_nope_head_dim, "v_head_dim": info.v_head_dim}
    try:
        other = Eagle3Config.for_target(target, min(hcfg.draft_vocab_size, info.vocab_size),
                                        attention="gqa" if hcfg.attention == "mla" else "mla")
    except UserError:
        return None
    return kv_bytes_per_token(other)


def attention_checks(spec: HeadSpec, info: ArchInfo) -> list[Check]:
    """The draft's attention against the target's: MLA sizes, KV cache bytes per token."""
    hcfg = spec.config
    checks = []
    cfg = _config_of(spec, info)
    if hcfg.attention == "mla":
        m = spec.mla
        latent = m["kv_lora_rank"] + m["qk_rope_head_dim"]
        if not m["q_lora_rank"]:
            checks.append(Check("MLA shapes", FAIL, "q_lora_rank is null: SGLang's MLA draft refuses it", "sglang"))
        if info.attention == "MLA":
            want = {"kv_lora_rank": info.kv_lora_rank, "qk_rope_head_dim": info.qk_rope_head_dim,
                    "qk_nope_head_dim": info.qk_nope_head_dim, "v_head_dim": info.v_head_dim or info.qk_nope_head_dim}
            latent_off = [k for k in ("kv_lora_rank", "qk_rope_head_dim") if m[k] != want[k]]
            other_off = [k for k in ("qk_nope_head_dim", "v_head_dim") if m[k] != want[k]]
            if latent_off:
                checks.append(Check("MLA shapes", FAIL, "latent " + ", ".join(f"{k} {m[k]} != the target's {want[k]}"
                                                                               for k in latent_off)
                                    + ": the engines run the draft on the target's MLA attention backend, whose "
                                    f"kernels take the target's {info.kv_lora_rank} + {info.qk_rope_head_dim} layout"))
            elif hcfg.num_attention_heads != info.num_heads or other_off:
                diff = [f"{k} {m[k]} vs {want[k]}" for k in other_off]
                if hcfg.num_attention_heads != info.num_heads:
                    diff.append(f"{hcfg.num_attention_heads} heads vs {info.num_heads}")
                checks.append(Check("MLA shapes", WARN, f"latent {m['kv_lora_rank']} + {m['qk_rope_head_dim']} as the "
                                    f"target's, but {', '.join(diff)}: tensor-parallel splits follow the draft's heads"))
            else:
                checks.append(Check("MLA shapes", PASS, f"{hcfg.num_attention_heads} heads, q_lora {m['q_lora_rank']}, "
                                    f"latent {m['kv_lora_rank']} + rope {m['qk_rope_head_dim']}, nope "
                                    f"{m['qk_nope_head_dim']}, v {m['v_head_dim']}: the target's MLA layout"))
        else:
            checks.append(Check("MLA shapes", WARN, f"MLA draft (latent {m['kv_lora_rank']} + {m['qk_rope_head_dim']}) "
                                f"on a {info.attention} target: the engine needs an MLA attention backend for the draft "
                                "beside the target's"))
        layout, other_kind = f"as the engines cache it (latent {latent})", "a GQA head"
    else:
        if info.attention == "MLA":
            checks.append(Check("attention", WARN, f"MLA target (kv_lora_rank {info.kv_lora_rank}): the EAGLE-3 draft is "
                                "a GQA Llama layer; give it its own attention backend, e.g. \"attention_backend\": "
                                "\"FLASH_ATTN\" in --speculative-config (vLLM PR 39930)", "vllm"))
        layout, other_kind = f"({hcfg.num_key_value_heads} kv heads x {hcfg.head_dim}, keys and values)", "an MLA head"
    if cfg is not None:
        other = _other_kind(spec, info)
        vs = f"; {other_kind} for this target: {other['engine']} B" if other else ""
        checks.append(Check("draft KV cache", PASS, f"{kv_bytes_per_token(cfg)['engine']} B per token in bf16 {layout}{vs}"))
    return checks


def option_checks(spec: HeadSpec) -> list[Check]:
    """EAGLE 3.1 options and the sliding window: does each engine read them?"""
    hcfg = spec.config
    options: dict[str, Any] = {**spec.options, "sliding_window": hcfg.sliding_window}
    used = [k for k, v in options.items() if v]
    if not used:
        return []
    checks = []
    for engine in ("vllm", "sglang"):
        if engine == "sglang" and spec.source == "speculators":
            continue
        blocking, caveats = option_issues(hcfg.attention, options, engine)
        label = LABEL[engine]
        if blocking:
            checks.append(Check("draft options", FAIL, f"{label} does not read {', '.join(blocking)}: it would run "
                                f"this head without them, not as trained", engine))
        elif caveats:
            checks.append(Check("draft options", WARN, f"{label}: " + "; ".join(caveats), engine))
        else:
            checks.append(Check("draft options", PASS, f"{label} reads {', '.join(used)}", engine))
    return checks


def _read_small_tensors(path: Path, names: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """(the named tensors, all tensor shapes) of a head folder, reading only what is needed."""
    from safetensors import SafetensorError, safe_open

    files = weight_source(path)
    if files is None:
        return {}, {}
    if isinstance(files, dict):  # a pytorch_model.bin
        return {k: files[k] for k in names if k in files}, {k: tuple(v.shape) for k, v in files.items()}
    tensors: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as handle:
                for k in handle.keys():
                    shapes[k] = tuple(handle.get_slice(k).get_shape())
                    if k in names:
                        tensors[k] = handle.get_tensor(k)
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {f}: {e} (the file is corrupt or truncated)") from None
    return tensors, shapes


def _finite_check(path: Path) -> Check:
    """Every floating-point tensor free of NaN and Inf (read one tensor at a time)."""
    from safetensors import SafetensorError, safe_open

    files = weight_source(path)
    bad: list[str] = []
    if isinstance(files, dict):
        bad = [f"{k} ({n})" for k, t in sorted(files.items()) if (n := nonfinite(t))]
    for f in files if isinstance(files, list) else []:
        try:
            with safe_open(f, framework="pt") as handle:
                bad += [f"{k} ({n})" for k in sorted(handle.keys()) if (n := nonfinite(handle.get_tensor(k)))]
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {f}: {e} (the file is corrupt or truncated)") from None
    if bad:
        return Check("finite weights", FAIL, f"NaN or Inf in {', '.join(bad[:3])}"
                     + (f" and {len(bad) - 3} more" if len(bad) > 3 else "") + ": the head is damaged, retrain it")
    return Check("finite weights", PASS, "no NaN or Inf in any tensor")


def _our_name(k: str) -> str:
    k = k[len("model."):] if k.startswith("model.") else k
    k = "midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k
    for legacy, new in _LEGACY.items():
        k = new + k[len(legacy):] if k.startswith(legacy) else k
    return k


def weights_checks(path: Path, spec: HeadSpec, info: ArchInfo) -> list[Check]:
    hcfg = spec.config
    import torch

    tensors, shapes = _read_small_tensors(path, ("d2t", "t2d"))
    if not shapes:
        return [Check("d2t", WARN, "no weights in the draft folder: draft vocabulary mapping not checked")]
    checks = []
    try:
        cfg = spec.eagle3_config(info.num_layers, info.model_type)
    except UserError as e:
        return [Check("weights", WARN, f"not checked: {e}")]
    expected = expected_shapes(cfg)
    renamed = {_our_name(k): s for k, s in shapes.items()}
    renamed = {k: s for k, s in renamed.items() if k not in _DROPPED}
    if "mask_hidden" in renamed:  # vLLM flattens it to [1, n]; without parallel drafting it is skipped
        n = 1
        for d in renamed.pop("mask_hidden"):
            n *= d
        if cfg.parallel_drafting:
            renamed["mask_hidden"] = (1, n)
    core = {k: v for k, v in expected.items() if k not in ("d2t", "t2d")}
    unknown = sorted(set(renamed) - set(expected))
    missing = sorted(set(core) - set(renamed))
    wrong = [f"{k} {renamed[k]} != {core[k]}" for k in core if k in renamed and renamed[k] != core[k]]
    if unknown or missing or wrong:
        detail = "; ".join(p for p in (f"unknown {unknown[:3]}" if unknown else "", f"missing {missing[:3]}" if missing
                                       else "", f"shapes {wrong[:2]}" if wrong else "") if p)
        checks.append(Check("weights", FAIL, f"tensors disagree with config.json: {detail}"))
    else:
        checks.append(Check("weights", PASS, f"{len(renamed)} tensors match config.json"))
    checks.append(_finite_check(path))
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None:
        if hcfg.draft_vocab_size == hcfg.vocab_size:
            checks.append(Check("d2t", PASS, "no d2t; the draft vocabulary is the whole vocabulary (identity)"))
        else:
            checks.append(Check("d2t", FAIL, f"no d2t although the draft vocabulary ({hcfg.draft_vocab_size}) is "
                                f"smaller than the vocabulary: draft ids cannot be mapped to target ids"))
        return checks
    d2t = d2t.long()
    targets = torch.arange(d2t.numel()) + d2t
    problems = []
    if d2t.numel() != hcfg.draft_vocab_size:
        problems.append(f"length {d2t.numel()} != draft vocab {hcfg.draft_vocab_size}")
    if d2t.numel() and (int(targets.min()) < 0 or int(targets.max()) >= info.vocab_size):
        problems.append(f"maps outside the target vocabulary 0..{info.vocab_size - 1}")
    elif targets.unique().numel() != targets.numel():
        problems.append("maps two draft ids to one target id")
    if t2d is not None and not problems:
        t2d = t2d.bool()
        if t2d.numel() != info.vocab_size or int(t2d.sum()) != d2t.numel() or not bool(t2d[targets].all()):
            problems.append("t2d disagrees with d2t")
    if problems:
        checks.append(Check("d2t", FAIL, "invalid draft vocabulary mapping: " + "; ".join(problems)))
    else:
        checks.append(Check("d2t", PASS, f"maps {d2t.numel()} draft ids to distinct target ids"))
    return checks


def parallel_checks(path: Path, spec: HeadSpec) -> list[Check]:
    """P-EAGLE: whether config.json (``mask_token_id``; ``parallel_drafting``) and the checkpoint
    (``mask_hidden``) agree, and what serves the head (vLLM's ``parallel_drafting``; no SGLang)."""
    cfg = spec.config
    _, shapes = _read_small_tensors(path, ())
    mask = next((s for k, s in shapes.items() if k.endswith("mask_hidden")), None)
    if not cfg.parallel_drafting:
        if mask is None:
            return []
        return [Check("parallel drafting", WARN, f"the checkpoint holds mask_hidden {list(mask)} but config.json names "
                      "no mask_token_id: vLLM skips mask_hidden (with a warning) and this runs as an EAGLE-3 chain; add "
                      "mask_token_id (the placeholder token it was trained with) to serve it as P-EAGLE")]
    token = cfg.mask_token_id
    if type(token) is not int or token < 0:
        return [Check("parallel drafting", FAIL, "config.json asks for parallel drafting but names no mask_token_id: "
                      "vLLM refuses it (it reads mask_token_id or ptd_token_id)")]
    if token >= cfg.vocab_size:
        return [Check("parallel drafting", FAIL, f"mask_token_id {token} is outside the vocabulary 0..{cfg.vocab_size - 1}")]
    if shapes and mask is None:
        return [Check("parallel drafting", FAIL, f"config.json says parallel drafting (mask_token_id {token}) but the "
                      "checkpoint has no mask_hidden: vLLM refuses to load it")]
    return [Check("parallel drafting", PASS, f"P-EAGLE head (placeholder token {token}, mask_hidden "
                  f"{list(mask) if mask else 'not checked: no weights'}): vLLM serves it with "
                  "--speculative-config '{\"method\": \"eagle3\", ..., \"parallel_drafting\": true}'; outrider with "
                  "--method parallel", engine="vllm"),
            Check("parallel drafting", FAIL, "SGLang serves no P-EAGLE heads", engine="sglang")]
