"""Served vs offline: the same prompts decoded here, greedy and with the head the server loaded.

Contract:
- ``local_run(target, texts, max_new_tokens, draft=None, k=3, method="eagle3")`` loads the target
  once, renders each prompt with its chat template (``bench.local.render_prompt``, as the server's
  chat endpoint does), and decodes greedily with our engine at batch 1: the plain outputs (text and
  ids) and, with ``draft`` (the head folder of ``method``, loaded by ``interop.drafts``), the
  head's walked tau and acceptance per position over the same prompts at ``k`` (our engine's
  decode: every step's accepted drafts), and
  ``uncut_tau``, the same counted as the engines' counters count it (a step cut by
  ``max_new_tokens`` or EOS keeps every draft the verifier accepted): the figure a served tau equals.
- ``compare_outputs(served, local)`` says per prompt whether the served text equals ours, and
  where the first difference is.
- ``gap(served_tau, offline_tau, checks, engine)`` judges the served tau against the offline one:
  ``relative_difference`` is served / offline - 1 (the offline tau counted as the engine counts);
  flagged when the served engine accepts less than ``RATIO`` of the drafts per step that the
  head accepts here ((served - 1) < RATIO x (offline - 1)); it then lists the ``inspect``
  findings (warn or fail) that explain such gaps for that engine (aux ids as each engine reads
  them, draft options such as ``norm_before_residual`` and sliding windows, ``d2t``, the
  tokenizer and chat template, weights) and names the checks to run by hand when none is found.

Not done here: the served measurement (``served.measure``), sampled decoding, trees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

RATIO = 0.7  # served accepted drafts per step below this share of the offline ones: flagged

# inspect rows that explain a head that accepts here and not in the engine
GAP_CHECKS = ("aux layer ids", "aux ids as read", "aux id convention", "draft options", "d2t", "tokenizer",
              "special tokens", "chat template", "weights", "draft architecture", "trained for")
BY_HAND = ("aux ids as each engine reads them (SGLang adds 1 to explicit ids unless the first is 1)",
           "norm_before_residual and other draft options the engine must read",
           "the d2t vocabulary map", "the tokenizer and vocabulary", "the chat template the server applies",
           "sliding-window settings of the draft")


@dataclass
class LocalRun:
    prompt_ids: list[list[int]]
    outputs: list[str]
    output_ids: list[list[int]]
    tau: float | None = None
    accept_rate_per_pos: list[float] = field(default_factory=list)
    k: int | None = None
    uncut_tau: float | None = None


def local_run(target: str, texts: Sequence[str], max_new_tokens: int, draft: str | None = None, k: int = 3,
              device: str | None = None, dtype: str | None = None, method: str = "eagle3") -> LocalRun:
    from outrider.bench.local import render_prompt
    from outrider.decode.engine import SpecEngine, eos_token_ids
    from outrider.decode.proposers import PROPOSERS
    from outrider.decode.state import GenerationResult
    from outrider.interop.drafts import build_proposer
    from outrider.models import load_model

    model, tok = load_model(target, device=device, dtype=dtype)
    eos = eos_token_ids(model, tok)
    prompts = [render_prompt(tok, t, 1 << 30) for t in texts]
    plain = SpecEngine(model, None, eos_ids=eos, graphs=False, compile=False)
    out_ids = [plain.generate([p], max_new_tokens).tokens[0] for p in prompts]
    run = LocalRun(prompts, [tok.decode(o, skip_special_tokens=True) for o in out_ids], out_ids)
    if draft is not None:
        proposer = build_proposer(method, PROPOSERS[method], model, tok, draft)
        spec = SpecEngine(model, proposer, k=k, eos_ids=eos, graphs=False, compile=False)
        pooled = GenerationResult.pooled([spec.generate([p], max_new_tokens) for p in prompts])
        run.tau = pooled.tau if pooled.row_steps else None
        run.uncut_tau = pooled.uncut_tau if pooled.row_steps else None
        run.accept_rate_per_pos = pooled.accept_rate_per_pos
        run.k = k
    return run


def compare_outputs(served: Sequence[str | None], local: Sequence[str]) -> dict[str, Any]:
    """Per prompt: equal, or the character where the served text first differs from ours."""
    rows = []
    for i, (s, l) in enumerate(zip(served, local)):
        if s is None:
            rows.append({"prompt": i, "equal": False, "first_difference": None, "note": "the request failed"})
            continue
        s, l = s.strip(), l.strip()
        j = next((n for n, (x, y) in enumerate(zip(s, l)) if x != y), min(len(s), len(l)))
        same = s == l
        rows.append({"prompt": i, "equal": same, "first_difference": None if same else j,
                     "served": None if same else s[max(0, j - 20):j + 40],
                     "local": None if same else l[max(0, j - 20):j + 40]})
    return {"equal": sum(r["equal"] for r in rows), "compared": len(rows), "rows": rows}


def gap(served_tau: float | None, offline_tau: float | None, checks: Sequence[Any] = (),
        engine: str | None = None) -> dict[str, Any]:
    """The served-vs-offline verdict (see the module docstring); ``checks`` are inspect's rows."""
    if served_tau is None:
        return {"flagged": False, "verdict": "not judged: the server reports no acceptance counters"}
    if offline_tau is None or offline_tau <= 1.05:
        return {"flagged": False, "verdict": f"not judged: the head accepts almost nothing here (tau "
                                             f"{offline_tau if offline_tau is not None else '-'})"}
    share = (served_tau - 1.0) / (offline_tau - 1.0)
    rel = served_tau / offline_tau - 1.0
    if share >= RATIO:
        return {"flagged": False, "share": share, "relative_difference": rel,
                "verdict": f"served tau {served_tau:.2f} is close to the head's tau here {offline_tau:.2f} "
                           f"({share:.0%} of its accepted drafts per step)"}
    findings = [f"{c.name}{f' [{c.engine}]' if c.engine else ''}: {c.status}: {c.reason}" for c in checks
                if c.status in ("warn", "fail") and c.name in GAP_CHECKS
                and (c.engine is None or engine is None or c.engine == engine)]
    return {"flagged": True, "share": share, "relative_difference": rel, "findings": findings,
            "check_by_hand": [] if findings else list(BY_HAND),
            "verdict": f"served tau {served_tau:.2f} is far below the head's tau here {offline_tau:.2f} "
                       f"(the engine accepts {share:.0%} of the drafts per step we do): "
                       + ("; ".join(findings) if findings else "inspect finds nothing; check by hand: "
                          + "; ".join(BY_HAND))}
