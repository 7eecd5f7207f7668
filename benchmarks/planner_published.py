"""The planner against published speculative-decoding measurements on large MoE targets.

    python benchmarks/planner_published.py [--out published.json]

For each case of ``outrider.plan.published.CASES`` (the source and setup printed with it): the
published speedup by batch, the planner's prediction from the spec-sheet profile, and from the
profile fitted to the case's own published plain-decoding speeds where it gives them (never to a
speculative figure); then where the planner is off and why. Last, the issue's Kimi-K2.5 profile on
8 x RTX PRO 6000: the fitted plain rate and n-gram at the planner's assumed acceptance on
reasoning output, against the 9-26 % loss measured there. CPU only, seconds.
"""

from __future__ import annotations

import argparse
import textwrap

from outrider.fsutil import atomic_write_json
from outrider.plan.published import (
    CASES,
    ISSUE_NGRAM_SLOWER,
    ISSUE_PROFILE,
    VLLM_NGRAM_K,
    compare,
    issue_profile_check,
)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f} %"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the rows and the issue-profile check as JSON")
    ap.add_argument("--alpha", type=float, default=0.2, help="n-gram acceptance assumed on reasoning output")
    a = ap.parse_args()
    rows = compare()
    print("| case | batch | published | predicted (spec profile) | error | predicted (fitted to published plain "
          "speeds) | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cal = "-" if r["predicted_calibrated"] is None else f"{r['predicted_calibrated']:.2f}x"
        print(f"| {r['case']} | {r['batch']} | {r['published']:.2f}x | {r['predicted']:.2f}x | {_pct(r['error'])} | "
              f"{cal} | {_pct(r['error_calibrated'])} |")
    print()
    for c in CASES:
        print(f"- **{c.name}** ({c.source}; {c.setup}): " + textwrap.shorten(c.why, 10_000))
    chk = issue_profile_check(alpha=a.alpha)
    fit, ngram = chk["fit"], chk["ngram"]
    lo, hi = 1 - ISSUE_NGRAM_SLOWER[1], 1 - ISSUE_NGRAM_SLOWER[0]
    print(f"\nThe issue's profile ({ISSUE_PROFILE['source']}): Kimi-K2.5 INT4, 8 x RTX PRO 6000, TP 8, "
          f"{ISSUE_PROFILE['decode_tokens_per_s']['1']} tok/s, collectives {100 * ISSUE_PROFILE['collective_share']['1']:.1f} % "
          f"of decode, {ISSUE_PROFILE['collectives_per_token']} per token")
    print(f"fitted plain decode: {chk['plain_tokens_per_s']:.2f} tok/s; {fit.summary()}")
    for c in fit.changes:
        print(f"  {c.text()}")
    print(f"n-gram at alpha {a.alpha:g} (reasoning output rarely repeats), batch 1; measured there: "
          f"{lo:.2f}x-{hi:.2f}x (9-26 % slower)")
    print("| k | tau | verify / plain step (break-even tau) | predicted | in the measured range |")
    print("| --- | --- | --- | --- | --- |")
    for k, p in ngram.items():
        mark = " (vLLM's documented n-gram k)" if k == VLLM_NGRAM_K else ""
        inside = "yes" if lo <= p.speedup <= hi else ("a loss, larger" if p.speedup < lo else
                                                      ("a loss, smaller" if p.speedup < 1 else "no: a gain"))
        print(f"| {k}{mark} | {p.expected_tokens:.3f} | {chk['break_even_tau'][k]:.3f} | {p.speedup:.3f}x | {inside} |")
    if a.out:
        atomic_write_json(a.out, {"rows": rows, "issue_profile": {
            "plain_tokens_per_s": chk["plain_tokens_per_s"], "fit": fit.summary(),
            "ngram": {k: {"tau": p.expected_tokens, "speedup": p.speedup, "break_even_tau": chk["break_even_tau"][k]}
                      for k, p in ngram.items()}}})


if __name__ == "__main__":
    main()
