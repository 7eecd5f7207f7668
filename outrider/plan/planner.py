"""``outrider plan``: predicted speculative-decoding speedup per method, k and batch size.

Contract:
- ``plan(target, hardware, ...)`` needs no weights: ``target`` is a model folder or a
  config-only folder (read with ``load_config_dict`` + ``arch_info``), or a built-in preset
  (``presets.PRESETS``: ``kimi-k2.5``, ``deepseek-v3``, ``gpt-oss-120b``, ``default`` =
  SmolLM2-135M). ``hardware`` is a built-in profile name or a profile JSON file
  (``hardware.load_profile``).
- Acceptance per method comes from a bench JSON (``acceptance``: records, read by
  ``outrider.records``, with ``method``, ``k``, ``accept_rate_per_pos``, ``tau``), or from ``tau`` (at ``tau_k`` draft tokens) or
  ``alpha`` for EAGLE-3 (and a draft model); without a bench file, n-gram is planned at a
  low assumed acceptance (``NGRAM_ALPHA``) and the assumption is printed. Parallel drafting
  (method ``parallel``: one draft forward over k positions) and DFlash (``dflash``: one forward of
  its layers over k + 1, k at most its block's size - 1, both read from the record's drafter folder)
  are planned only from their records.
- Tree records (method ``eagle3`` with ``topk``/``steps``/``draft_tokens`` or ``tree_paths``, and
  ``tau``; ``trees.budget_of``) give one row per measured budget (method ``eagle3-tree``, tokens
  per round = the measured tau, never extrapolated); a topk-1 record is the chain k = steps.
  Rows carry ``draft`` (chain | tree | parallel | block), ``topk``/``steps``/``draft_tokens`` and
  ``launch`` (SGLang's flags for EAGLE-3 chains and trees). The recommendation is the fastest row
  that fits; chains come first, so a tree must be strictly faster to be chosen.
- ``calibrate`` is a bench JSON (or several, comma-separated) with measured step times (``ar_step_ms``,
  ``verify_step_ms``...) or a JSON object of measured inputs
  (``single_stream_tokens_per_s``, ``allreduce_share``, ``collectives_per_token``); see
  ``cost_model.calibrate`` / ``calibrate_measured``. ``measured`` is what a user measured on
  their cluster (decode tokens/s by batch, collective share and count, acceptance from our
  bench or vLLM's / SGLang's metrics): the profile's free parameters are fitted to it and the
  ones that moved are printed (``measured``).
- ``batching``: ``continuous`` (serving engines) or ``lockstep`` (our engine: a batch runs as long
  as its slowest row, ``batching``).
- Prints one table per batch size (method x k: expected tokens, verify/step cost ratio,
  draft round, tokens/s, speedup) and a recommendation per batch naming the dominant cost
  terms; ``json_path`` receives the rows (atomically), each with the target, hardware, date and
  commit it was predicted for and by. Every user mistake is a one-line ``UserError``.

Memory: each row states the GB per GPU it needs (weights + KV cache of ``batch`` x (``context`` +
``new_tokens``) tokens at the target's KV bytes per token: MLA's latent, replicated over TP, or
GQA's keys and values, split by KV head); a row that does not fit the GPU says so, the notes give
the sizes, and the recommendation skips it.

Not done here: plots (``plan --plot`` draws ``rows`` through ``outrider.report.plots``, joined in
``cli``), measuring anything (``bench`` does), inventing tree budgets nobody measured,
activations and engine workspace in the memory estimate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from outrider.errors import UserError
from outrider.fsutil import read_json, write_json_output
from outrider.plan.acceptance import Acceptance
from outrider.plan.batching import (
    MODES,
    RoundsModel,
    RowSpread,
    batched,
    measured_spread,
    spread_from_bench,
)
from outrider.plan.calibrate import Calibration, calibrate_measured
from outrider.plan.calibrate import calibrate as fit_calibration
from outrider.plan.cost_model import (
    DraftSpec,
    ModelShape,
    Prediction,
    dflash_shape,
    eagle3_head_shape,
    kv_bytes_per_token,
    memory_per_gpu,
    predict,
    step_cost,
)
from outrider.plan.hardware import (
    HardwareProfile,
    default_precision,
    load_profile,
    parse_precision,
)
from outrider.plan.measured import Fit, fit_profile, load_measured
from outrider.plan.presets import resolve_target
from outrider.plan.trees import TreeEntry, predict_tree, sglang_launch, tree_entry
from outrider.records import read_records, records_of
from outrider.trees import TreeBudget, budget_of, shape_label, shape_of
from outrider.provenance import git_commit, today

PUBLISHED_EAGLE3_TAU = 3.0  # published EAGLE-3 heads for Kimi-K2.5: acceptance length ~2.7-3.3 at k=3
NGRAM_ALPHA = 0.2  # assumed n-gram acceptance on reasoning output, which rarely repeats
METHODS = ("eagle3", "draft", "ngram", "parallel", "dflash")
TREE_METHODS = ("eagle3",)  # methods whose draft trees are priced (EAGLE-2 over an EAGLE-3 head)


@dataclass(frozen=True)
class Recommendation:
    batch: int
    method: str | None  # None: do not speculate
    k: int | None
    speedup: float
    tokens_per_s: float
    text: str
    draft: str | None = None  # chain | tree | parallel
    tree: tuple[int, int, int] | None = None  # SGLang's (topk, steps, draft_tokens)
    launch: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "method": self.method, "k": self.k, "speedup": self.speedup,
                "tokens_per_s": self.tokens_per_s, "text": self.text, "draft": self.draft,
                "topk": self.tree[0] if self.tree else None, "steps": self.tree[1] if self.tree else None,
                "draft_tokens": self.tree[2] if self.tree else None, "launch": self.launch}


@dataclass
class PlanResult:
    target: str
    hardware: HardwareProfile
    tp: int
    context: int
    predictions: list[Prediction]
    recommendations: list[Recommendation]
    acceptance_sources: dict[str, str]
    calibration: Calibration | None = None
    notes: list[str] = field(default_factory=list)
    fit: Fit | None = None
    batching: str = "continuous"

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The JSON rows: each prediction with what it was predicted for, when and by which commit."""
        where = {"target": self.target, "hardware": self.hardware.name, "tp": self.tp, "context": self.context,
                 "date": today(), "git_commit": git_commit()}
        return [{**p.to_row(), **where} for p in self.predictions]

    def best(self, batch: int) -> Prediction | None:
        cands = [p for p in self.predictions if p.batch == batch]
        return max(cands, key=lambda p: p.speedup) if cands else None


def acceptance_from_bench(path: str) -> dict[str, dict[int, Acceptance]]:
    """method -> k -> Acceptance from a bench JSON; autoregressive records are skipped, tree records
    (``topk`` > 1) are left to ``trees_from_bench``, topk-1 ones are the chain k = steps."""
    return bench_acceptance(path)[0]


def trees_from_bench(path: str) -> dict[str, dict[TreeBudget, TreeEntry]]:
    """method -> measured budget (topk, steps, draft_tokens) -> its tau, from a bench JSON."""
    return bench_acceptance(path)[1]


def bench_acceptance(path: str) -> tuple[dict[str, dict[int, Acceptance]], dict[str, dict[TreeBudget, TreeEntry]]]:
    """Chains (method -> k -> Acceptance) and trees (method -> budget -> TreeEntry) of a bench JSON."""
    out: dict[str, dict[int, Acceptance]] = {}
    trees: dict[str, dict[TreeBudget, TreeEntry]] = {}
    for i, r in enumerate(read_records(path, "acceptance")):
        method = r.method
        if method == "ar":
            continue
        if r.tree is not None:
            where = f"{path}: record {i} ({method})"
            budget = budget_of(r, where)
            if not budget.is_chain:
                trees.setdefault(method, {})[budget] = tree_entry(r, where, Path(path).name)
                continue
            r = {**r, "k": budget.steps}  # topk 1: the chain of k = steps
        k = r.get("k")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise UserError(f"{path}: record {i} ({method}) needs an integer 'k' >= 1")
        _check_tau(r, k, f"{path}: record {i} ({method})")
        out.setdefault(method, {})[k] = Acceptance.from_record(r, origin=Path(path).name)
    if not out and not trees:
        raise UserError(f"{path}: no speculative records (method eagle3, ngram or draft) to take acceptance from")
    return out, trees


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_tau(r: Mapping[str, Any], k: int, where: str) -> None:
    """Refuse a record whose tau breaks its definition: tokens emitted per verify step, so within
    [1, k+1], within what a step can emit under ``max_new_tokens`` (the prefill yields the first
    token), and, with the per-batch figures, at most the tokens the steps emitted."""
    tau = r.get("tau")
    if tau is None:
        return
    if not _number(tau):
        raise UserError(f"{where}: 'tau' must be a number, got {tau!r}")
    cap = k + 1
    max_new = r.get("max_new_tokens")
    if _number(max_new) and max_new >= 2:
        cap = min(cap, int(max_new) - 1)
    if not 1.0 <= tau <= cap + 1e-9:
        raise UserError(f"{where}: tau {tau:g} is impossible: tokens per step lie in [1, {cap}] at k={k}"
                        + (f" and max_new_tokens={max_new}" if cap < k + 1 else "") + ": re-measure with `outrider bench`")
    taus, steps, new, prompts = (r.get(x) for x in ("tau_per_batch", "row_steps_per_batch", "new_tokens",
                                                    "num_prompts"))
    if (isinstance(taus, list) and isinstance(steps, list) and len(taus) == len(steps)
            and all(map(_number, taus + steps)) and _number(new) and _number(prompts)):
        emitted = sum(t * n for t, n in zip(taus, steps))
        if emitted > new - prompts + 1e-6 * max(new, 1):
            raise UserError(f"{where}: tau per batch x steps counts {emitted:g} tokens, more than the {new - prompts:g} "
                            "the steps emitted: re-measure with `outrider bench`")


def _spread(path: str) -> RowSpread | None:
    """Rows of the first batch-1 record with per-prompt tau and steps (``bench`` writes them)."""
    for r in read_records(path, "acceptance"):
        taus, steps = r.get("tau_per_batch"), r.get("row_steps_per_batch")
        if (r.get("batch_size", 1) == 1 and r.method in METHODS and r.tree is None and isinstance(taus, list)
                and isinstance(steps, list) and len(taus) == len(steps) >= 4):
            acc = Acceptance.from_record(r, origin=Path(path).name)
            return spread_from_bench(acc.rates, taus, steps, int(r.get("max_new_tokens", 128)),
                                     f"{Path(path).name} ({len(taus)} prompts at batch 1)")
    return None


def check_tp(tp: int, arch: Any, name: str) -> None:
    """Refuse a tensor-parallel size the engines cannot shard the target over: it must divide the
    attention heads, and (GQA) divide the KV heads or be a multiple of them (vLLM's rule: KV
    heads are then replicated)."""
    heads, kv = int(arch.num_heads), int(arch.num_kv_heads or arch.num_heads)
    mla = bool(getattr(arch, "kv_lora_rank", 0))
    if heads % tp or (not mla and kv % tp and tp % kv):
        sizes = [t for t in range(1, heads + 1) if not heads % t and (mla or not kv % t or not t % kv)]
        raise UserError(f"--tp {tp} cannot shard {name}: it has {heads} attention heads"
                        + ("" if mla else f" and {kv} KV heads") + f"; use one of {', '.join(map(str, sizes))}")


def _pick(table: dict[int, Acceptance], k: int) -> Acceptance:
    """The record measured at this k, else the one with the most positions (largest k)."""
    return table[k] if k in table else table[max(table)]


def _positive_ints(values: Sequence[int], what: str) -> list[int]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"{what} must be integers >= 1, got {v!r}")
        out.append(v)
    if not out:
        raise UserError(f"give at least one {what}")
    return sorted(set(out))


def _histogram(path: str) -> list[float]:
    data = read_json(path, "routing histogram")
    if not isinstance(data, list) or not data or any(isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0
                                                      for x in data):
        raise UserError(f"{path}: a routing histogram is a JSON list of token counts per expert (numbers >= 0)")
    return [float(x) for x in data]


def _load_calibration(path: str, shape: ModelShape, hw: HardwareProfile, tp: int, context: int) -> Calibration:
    if "," in path and not Path(path).exists():  # several bench files: their records fitted together
        parts = [p for p in path.split(",") if p]
        records = [r for p in parts for r in records_of(read_json(p, "calibration"), p)]
        return fit_calibration(records, shape, hw, tp, context, origin=", ".join(Path(p).name for p in parts))
    data = read_json(path, "calibration")
    name = Path(path).name
    if isinstance(data, dict) and "single_stream_tokens_per_s" in data:
        allowed = {"single_stream_tokens_per_s", "allreduce_share", "collectives_per_token"}
        extra = sorted(set(data) - allowed)
        if extra:
            raise UserError(f"{path}: unknown key(s) {', '.join(extra)} in measured inputs "
                            f"(allowed: {', '.join(sorted(allowed))})")
        return calibrate_measured(shape, hw, tp, data["single_stream_tokens_per_s"], data.get("allreduce_share"),
                                  data.get("collectives_per_token"), context, origin=name)
    return fit_calibration(records_of(data, path), shape, hw, tp, context, origin=name)


def _term_list(terms: list[tuple[str, float]]) -> str:
    return ", ".join(f"{n} {s:.0%}" for n, s in terms)


def _tree_acceptance(entry: TreeEntry) -> Acceptance:
    """A tree's accepted length per round as a chain of ``steps`` (its per-depth rates, gated to its
    tau), for the lockstep rounds model only."""
    b = entry.budget
    if entry.rates:
        return Acceptance.from_record({"method": "eagle3-tree", "k": b.steps, "tau": entry.tau,
                                       "accept_rate_per_pos": list(entry.rates)}, origin=entry.source)
    if entry.tau >= b.steps + 1:
        return Acceptance((1.0,), entry.source)
    return Acceptance.from_tau(entry.tau, b.steps, source=entry.source)


def _option(p: Prediction, sep: str = " with ") -> str:
    """A row's method and its setting: k, or a tree's budget."""
    if p.draft_kind == "tree" and p.tree:
        return f"{p.method} {shape_label(p.tree)}"
    return f"{p.method}{sep}k={p.k}"


def _dflash_shape(acceptance: str | None) -> tuple[int, int, int | None]:
    """(layers, block_size, kv heads or None for the target's) of the DFlash drafter a bench file's
    ``dflash`` record ran (its folder's config.json); (1, the record's k + 1, None) when it cannot be
    read, (1, 65, None) without a record."""
    if acceptance is None:
        return 1, 65, None
    records = [r for r in read_records(acceptance) if r.method == "dflash"]
    for r in records:
        folder = Path(str(r.get("draft") or "")).expanduser()
        try:
            cfg = json.loads((folder / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        layers, block, kv = cfg.get("num_hidden_layers"), cfg.get("block_size"), cfg.get("num_key_value_heads")
        if isinstance(layers, int) and layers >= 1 and isinstance(block, int) and block >= 2:
            return layers, block, kv if isinstance(kv, int) and kv >= 1 else None
    return 1, max([int(r.k or 1) + 1 for r in records] or [65]), None


def _launch(p: Prediction) -> Prediction:
    """Name a chain or parallel row's serving settings (trees name theirs in ``predict_tree``)."""
    if p.method == "eagle3" and p.draft_kind == "chain":
        shape = shape_of(None, p.k)
        return replace(p, tree=shape, launch=sglang_launch(shape))
    if p.method == "parallel":
        return replace(p, launch=f"vLLM --speculative-config '{{\"method\": \"eagle3\", \"model\": HEAD, "
                                 f"\"num_speculative_tokens\": {p.k}, \"parallel_drafting\": true}}'")
    if p.method == "dflash":
        return replace(p, launch=f"vLLM --speculative-config '{{\"method\": \"dflash\", \"model\": DRAFTER, "
                                 f"\"num_speculative_tokens\": {p.k}}}'")
    return p


def _recommend(batch: int, preds: list[Prediction], need: float = 0.0,
               hw: HardwareProfile | None = None) -> Recommendation:
    """The fastest of ``preds`` (the rows that fit memory); none fit: say so (``need`` bytes per GPU)."""
    if not preds:
        cap = f" > {hw.memory_capacity_bytes / 1e9:.0f} GB" if hw is not None else ""
        return Recommendation(batch, None, None, 0.0, 0.0, f"batch {batch}: does not fit: {need / 1e9:,.1f} GB per "
                              f"GPU of weights and KV cache{cap}; lower the batch or --context, or raise --tp")
    best = max(preds, key=lambda p: p.speedup)  # first of equals: chains before trees
    if best.speedup > 1.0:
        text = (f"batch {batch}: {_option(best)} -> {best.speedup:.2f}x "
                f"({best.tokens_per_s:,.0f} vs {best.ar_tokens_per_s:,.0f} tok/s); "
                f"{best.expected_tokens:.2f} tokens per step for {best.verify_cost_ratio:.2f}x the cost of a plain step; "
                f"dominant terms: {_term_list(best.dominant(3))}" + (f"; launch: {best.launch}" if best.launch else ""))
        return Recommendation(batch, best.method, best.k, best.speedup, best.tokens_per_s, text, best.draft_kind,
                              best.tree, best.launch)
    verify_shares = best.verify.shares()
    text = (f"batch {batch}: do not speculate: the best option, {_option(best, ' ')}, predicts "
            f"{best.speedup:.2f}x: {best.expected_tokens:.2f} tokens per step do not pay for a verify step "
            f"{best.verify_cost_ratio:.2f}x a plain one plus {best.draft_round_s * 1e3:.2f} ms of drafting; "
            f"verify step dominated by {_term_list(verify_shares[:3])}")
    return Recommendation(batch, None, None, best.speedup, best.ar_tokens_per_s, text)


def plan(target: str, hardware: str, tp: int = 1, batches: Sequence[int] = (1,), acceptance: str | None = None,
         tau: float | None = None, alpha: float | None = None, ks: Sequence[int] = range(1, 8),
         weight_dtype: str | None = None, calibrate: str | None = None, context: int = 2048,
         json_path: str | None = None, console=None, *,
         tau_k: int = 3, draft: str | None = None, draft_vocab: int = 32000,
         routing_histogram: str | Sequence[float] | None = None, measured: Any = None,
         batching: str = "continuous", new_tokens: int = 128) -> PlanResult:
    """Predict tokens/s and speedup for each method x k x batch; print, and write the JSON rows.

    ``tau`` is the acceptance length measured at ``tau_k`` draft tokens (published K2.5 heads:
    ~3 at k=3); ``alpha`` the per-token acceptance. Both set EAGLE-3's (and ``draft``'s)
    acceptance. ``draft`` is a draft model (folder or preset) for the ``draft`` method.
    ``routing_histogram`` (a list, or a JSON file holding one) counts tokens per routed expert
    and replaces uniform routing in the distinct-expert estimate.
    ``measured`` (a JSON file or a ``measured.Measured``: decode tokens/s by batch, collective share
    and count, acceptance from our bench or vLLM's / SGLang's metrics) fits the profile
    (``measured.fit_profile``) and supplies acceptance for methods no flag gave. ``batching``:
    ``continuous`` (a serving engine) or ``lockstep`` (our engine: a batch runs as long as its
    slowest row, ``batching.RoundsModel``) over replies of up to ``new_tokens`` tokens, rows as
    unlike as the acceptance file's batch-1 per-prompt figures, else as our measured bench's.
    """
    from rich.console import Console

    console = console or Console()
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise UserError(f"--tp must be an integer >= 1, got {tp!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise UserError(f"context must be an integer >= 0, got {context!r}")
    batches = _positive_ints(list(batches), "batch sizes")
    ks = _positive_ints(list(ks), "k values")
    given = [n for n, v in (("--acceptance", acceptance), ("--tau", tau), ("--alpha", alpha)) if v is not None]
    if len(given) > 1:
        raise UserError(f"give only one of --acceptance, --tau, --alpha (got {', '.join(given)})")

    if isinstance(routing_histogram, (str, Path)):
        routing_histogram = _histogram(str(routing_histogram))
    name, arch, preset_prec = resolve_target(target)
    check_tp(tp, arch, name)
    if routing_histogram is not None and len(routing_histogram) != arch.num_experts:
        raise UserError(f"the routing histogram has {len(routing_histogram)} entries but {name} has "
                        f"{arch.num_experts} routed experts: give one token count per expert")
    precision = parse_precision(weight_dtype or preset_prec) if (weight_dtype or preset_prec) else default_precision(arch)
    shape = ModelShape.from_arch(arch, precision, name=name, routing_histogram=routing_histogram)
    hw = load_profile(hardware)
    notes: list[str] = []

    calibration = None
    if calibrate is not None:
        calibration = _load_calibration(calibrate, shape, hw, tp, context)
        hw = calibration.apply(hw)
        notes.append(calibration.summary())
    fit, measured_accept = None, {}
    if measured is not None:
        m = load_measured(measured)
        if m.decode:
            fit = fit_profile(shape, hw, tp, m, m.context if m.context is not None else context)
            hw = fit.profile
            notes.append(f"{m.source}: {fit.summary()}")
        measured_accept = m.acceptance
    if batching not in MODES:
        raise UserError(f"--batching must be one of {', '.join(MODES)}, got {batching!r}")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise UserError(f"--new-tokens must be an integer >= 1, got {new_tokens!r}")

    head = eagle3_head_shape(arch, draft_vocab)
    dflash_layers, dflash_block, dflash_kv = _dflash_shape(acceptance)
    drafts: dict[str, DraftSpec] = {"eagle3": head, "ngram": DraftSpec("ngram"),
                                    "parallel": replace(head, method="parallel"),
                                    "dflash": dflash_shape(arch, dflash_layers, draft_vocab, kv_heads=dflash_kv)}
    if draft is not None:
        dname, darch, dprec = resolve_target(draft)
        if darch.vocab_size != arch.vocab_size:
            notes.append(f"draft {dname} has vocab {darch.vocab_size}, target {arch.vocab_size}: "
                         f"a draft model must share the tokenizer to be served")
        dp = parse_precision(dprec) if dprec else default_precision(darch)
        drafts["draft"] = DraftSpec("draft", ModelShape.from_arch(darch, dp, name=dname))
    if calibration is not None:
        for method, table in calibration.draft_round_s.items():
            if method in drafts:
                drafts[method] = replace(drafts[method], measured_round_s=dict(table),
                                         measured_round_by_batch=dict(calibration.draft_round_by_batch.get(method, {})))
        for method, ttable in calibration.tree_round_s.items():
            if method in drafts:
                drafts[method] = replace(drafts[method], measured_tree_round_s=dict(ttable),
                                         measured_tree_round_by_batch=dict(calibration.tree_round_by_batch.get(method, {})))

    accept: dict[str, dict[int, Acceptance]]
    trees: dict[str, dict[TreeBudget, TreeEntry]] = {}
    sources: dict[str, str] = {}
    if acceptance is not None:
        accept, trees = bench_acceptance(acceptance)
        for m in sorted(set(trees) - set(TREE_METHODS)):
            notes.append(f"{Path(acceptance).name}: trees of method '{m}' are not modelled; skipped")
            del trees[m]
        for m in sorted(set(accept) - set(METHODS)):
            notes.append(f"{Path(acceptance).name}: method '{m}' is not modelled; skipped")
            del accept[m]
        if "draft" in accept and "draft" not in drafts:
            notes.append("acceptance has a 'draft' record but no --draft model was given; skipped")
            del accept["draft"]
        for m, table in accept.items():
            sources[m] = ", ".join(a.source for _, a in sorted(table.items()))
        for m, ttable in trees.items():
            sources[f"{m}-tree"] = ", ".join(e.source for _, e in sorted(ttable.items()))
    else:
        if tau is not None:
            spec_acc = Acceptance.from_tau(float(tau), tau_k)
        elif alpha is not None:
            spec_acc = Acceptance.from_alpha(float(alpha))
        else:
            spec_acc = Acceptance.from_tau(PUBLISHED_EAGLE3_TAU, 3,
                                           source=f"assumed tau={PUBLISHED_EAGLE3_TAU:g} at k=3 (published K2.5 EAGLE-3 heads)")
        accept = {"eagle3": {tau_k: spec_acc}}
        if "draft" in drafts:
            accept["draft"] = {tau_k: spec_acc}
        low = f"assumed alpha={NGRAM_ALPHA:g} (low: reasoning output rarely repeats)"
        accept["ngram"] = {1: Acceptance.from_alpha(NGRAM_ALPHA, source=low)}
        for m, table in accept.items():
            sources[m] = next(iter(table.values())).source
    for m, table in measured_accept.items():  # the user's measurements replace assumptions, not flags
        explicit = acceptance is not None or (m in ("eagle3", "draft") and (tau is not None or alpha is not None))
        if m in METHODS and not (explicit and m in accept) and (m != "draft" or "draft" in drafts):
            accept[m] = dict(table)
            sources[m] = ", ".join(a.source for _, a in sorted(table.items()))

    weights_per_gpu = shape.weight_bytes / tp
    if weights_per_gpu > hw.memory_capacity_bytes:
        notes.append(f"the weights need {weights_per_gpu / 1e9:.0f} GB per GPU but {hw.name} has "
                     f"{hw.memory_capacity_bytes / 1e9:.0f} GB: raise --tp (no row fits)")

    spread = (_spread(acceptance) if acceptance is not None else None) or measured_spread()
    if batching == "lockstep":
        notes.append(f"lockstep batches of replies up to {new_tokens} tokens, rows as unlike as {spread.source}")
    rounds: dict[tuple[str, Any], RoundsModel] = {}
    predictions: list[Prediction] = []
    for b in batches:
        for m in METHODS:
            if m not in accept:
                continue
            for k in ks:
                if m == "dflash" and k > dflash_block - 1:  # positions past the trained block: never trained
                    continue
                acc = _pick(accept[m], k)
                pred = predict(shape, hw, drafts[m], acc, k, b, tp, context)
                if batching == "lockstep":
                    if (m, k) not in rounds:
                        rounds[(m, k)] = RoundsModel(acc, k, spread, new_tokens)
                    pred = batched(pred, rounds[(m, k)], batching)
                predictions.append(_launch(pred))
        for m, ttable in trees.items():
            for budget, entry in sorted(ttable.items()):
                pred = predict_tree(shape, hw, drafts[m], budget, entry.tau, b, tp, context, method=f"{m}-tree")
                if batching == "lockstep":
                    key = (f"{m}-tree", budget)
                    if key not in rounds:
                        rounds[key] = RoundsModel(_tree_acceptance(entry), budget.steps, spread, new_tokens)
                    pred = batched(pred, rounds[key], batching)
                predictions.append(pred)
    kv_token, tokens = kv_bytes_per_token(shape, tp), context + new_tokens
    for i, p in enumerate(predictions):
        need = memory_per_gpu(shape, tp, p.batch, tokens)
        predictions[i] = replace(p, memory_bytes=need, fits=need <= hw.memory_capacity_bytes)
    for b in batches:
        need = memory_per_gpu(shape, tp, b, tokens)
        if need > hw.memory_capacity_bytes:
            notes.append(f"batch {b} does not fit: {need / 1e9:,.1f} GB per GPU ({shape.weight_bytes / tp / 1e9:,.1f} "
                         f"GB of weights + KV cache of {b} x {tokens} tokens (context {context} + {new_tokens} new) at "
                         f"{kv_token / 1e3:,.1f} kB/token/GPU, {shape.attention}) > {hw.memory_capacity_bytes / 1e9:.0f} "
                         f"GB on {hw.name}: its rows are marked and the recommendation skips them")
    recommendations = [_recommend(b, [p for p in predictions if p.batch == b and p.fits], memory_per_gpu(
        shape, tp, b, tokens), hw) for b in batches]
    result = PlanResult(name, hw, tp, context, predictions, recommendations, sources, calibration, notes, fit,
                        batching)

    _print(result, shape, console)
    if json_path is not None:
        write_json_output(json_path, result.rows)
    return result


def _print(result: PlanResult, shape: ModelShape, console) -> None:
    from rich.table import Table

    hw = result.hardware
    console.print(f"[bold]{result.target}[/bold] ({shape.precision.label}, {shape.weight_bytes / 1e9:.3g} GB of weights) "
                  f"on {result.tp} x {hw.name} (TP {result.tp}, {hw.interconnect}), context {result.context}")
    for method, src in result.acceptance_sources.items():
        console.print(f"  acceptance {method}: {src}")
    for b in sorted({p.batch for p in result.predictions}):
        preds = [p for p in result.predictions if p.batch == b]
        ar = step_cost(shape, hw, result.tp, 1, b, result.context)
        title = (f"batch {b}: autoregressive {preds[0].ar_tokens_per_s:,.0f} tok/s, step {ar.total_s * 1e3:.2f} ms "
                 f"({_term_list(ar.dominant(2))})")
        table = Table(title=title, title_justify="left")
        for col in ("method", "k", "topk,steps,tokens", "E\\[tok]", "verify/AR", "draft ms", "step ms", "tok/s", "speedup", "GB/GPU"):
            table.add_column(col, justify="left" if col == "method" else "right")
        for p in preds:
            style = "green" if p.speedup > 1.0 else "red"
            budget = ",".join(map(str, p.tree)) if p.tree else "-"
            table.add_row(p.method, str(p.k), budget, f"{p.expected_tokens:.2f}", f"{p.verify_cost_ratio:.2f}",
                          f"{p.draft_round_s * 1e3:.3f}", f"{(p.verify_step_s + p.draft_round_s) * 1e3:.2f}",
                          f"{p.tokens_per_s:,.0f}", f"[{style}]{p.speedup:.2f}x[/{style}]",
                          f"{p.memory_bytes / 1e9:,.0f}" + ("" if p.fits else " [red]no fit[/red]"))
        console.print(table)
    if result.fit is not None:
        console.print("[bold]Fitted to the measurements[/bold]")
        for c in result.fit.changes:
            console.print(f"  {c.text()}", highlight=False)
        for b, meas, fitted in result.fit.points:
            console.print(f"  batch {b}: measured {meas:,.1f} tok/s, fitted {fitted:,.1f}", highlight=False)
    console.print("[bold]Recommendation[/bold]")
    for r in result.recommendations:
        console.print(f"  {r.text}", highlight=False)
    for n in result.notes:
        console.print(f"  note: {n}")
