"""Acceptance from a serving engine's own Prometheus counters, read before and after a load level.

Contract:
- ``parse_exposition(text)`` reads the Prometheus text exposition format (comments, labels with
  escaped quotes, ``NaN``/``+Inf``, optional timestamps) into ``Sample`` rows; a line it cannot
  read is skipped, ``_created`` samples are dropped.
- ``engine_of(samples)`` names the engine from its metric prefix: ``vllm``, ``sglang`` or None.
- ``acceptance(engine, before, after, ...)`` turns two scrapes into ``Served`` acceptance:
  * vLLM (names read from ``vllm/v1/spec_decode/metrics.py`` at vllm-project/vllm commit
    ee4ceaae5953d367d8edd2132fd86d6c42506e1e, class ``SpecDecodingProm``): the counters
    ``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``,
    ``vllm:spec_decode_num_accepted_tokens`` and ``vllm:spec_decode_num_accepted_tokens_per_pos``
    (label ``position``, 0-based, one per speculative token), exposed by ``prometheus_client``
    with a ``_total`` suffix, labelled by ``model_name`` and ``engine`` (summed here). Over the
    level's difference: tau = 1 + accepted / drafts (vLLM's mean acceptance length, bonus
    included), rate at position i = accepted_per_pos[i] / drafts (P(at least i+1 drafts
    accepted)), k = the number of positions.
  * SGLang (``python/sglang/srt/metrics/collector.py`` at sgl-project/sglang commit
    00ae9c1590d2d0bb6c0bfff39e312c34ae3dd538, ``SchedulerMetricsCollector``; the figure is computed
    in ``scheduler_metrics_mixin.py`` at 01bb3c807f7e62c19a31de7548837505488c2b64): the gauges
    ``sglang:spec_accept_length`` (accepted tokens plus one per request, per verify forward: tau)
    and ``sglang:spec_accept_rate``, set at each decode log interval over that interval only, 0
    when speculation is off. SGLang publishes no cumulative counter, so the value after the
    level is its last log interval's (stated in the result); k is not in the metrics and comes
    from ``/get_server_info`` (``speculative_num_steps``) when given.
  * anything else, or an engine whose counters are absent or did not move: ``Served`` with
    ``tau`` None and the reason, "no acceptance counters"; nothing is guessed.
  The counters are the whole server's: other clients' traffic during a level is counted too.

Not done here: scraping (``served.client``), per-request acceptance, sampling-mode corrections.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

NO_COUNTERS = "no acceptance counters"

VLLM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"


@dataclass(frozen=True)
class Sample:
    name: str  # as exposed (a counter keeps its ``_total`` suffix)
    labels: Mapping[str, str]
    value: float


@dataclass
class Served:
    """Acceptance over one level: ``tau`` (tokens per verify step, bonus included) or None."""

    source: str  # which counters, or why there is no figure
    tau: float | None = None
    accept_rate_per_pos: list[float] = field(default_factory=list)  # unconditional: P(>= i+1 accepted)
    k: int | None = None
    drafts: float | None = None
    accepted_tokens: float | None = None
    draft_tokens: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"acceptance": self.source, "tau": self.tau, "accept_rate_per_pos": list(self.accept_rate_per_pos),
                "k": self.k, "spec_drafts": self.drafts, "spec_accepted_tokens": self.accepted_tokens,
                "spec_draft_tokens": self.draft_tokens}


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _value(text: str) -> float | None:
    try:
        return float(text)  # accepts NaN, +Inf, -Inf, exponents
    except ValueError:
        return None


def _sample(line: str) -> Sample | None:
    m = _NAME.match(line)
    if m is None:
        return None
    name, rest, labels = m.group(0), line[m.end():], {}
    if rest.startswith("{"):
        end, pos = None, 1
        while pos < len(rest):
            if rest[pos] == "}":
                end = pos
                break
            lm = _LABEL.match(rest, pos)
            if lm is None:
                return None
            labels[lm.group(1)] = re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], lm.group(2))
            pos = lm.end()
        if end is None:
            return None
        rest = rest[end + 1:]
    parts = rest.split()
    if not parts or len(parts) > 2:
        return None
    value = _value(parts[0])
    return None if value is None else Sample(name, labels, value)


def parse_exposition(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (see the module docstring)."""
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        s = _sample(line)
        if s is not None and not s.name.endswith("_created"):
            out.append(s)
    return out


def engine_of(samples: Sequence[Sample]) -> str | None:
    """``vllm`` or ``sglang`` from the metric names' prefix, else None."""
    for prefix in ("vllm", "sglang"):
        if any(s.name.startswith(prefix + ":") for s in samples):
            return prefix
    return None


def _counter(samples: Sequence[Sample], name: str, **match: str) -> float | None:
    """A counter summed over its other labels (``name`` or ``name_total``); None if absent."""
    hits = [s.value for s in samples if s.name in (name, name + "_total")
            and all(s.labels.get(k) == v for k, v in match.items()) and math.isfinite(s.value)]
    return sum(hits) if hits else None


def _per_pos(samples: Sequence[Sample]) -> dict[int, float]:
    out: dict[int, float] = {}
    for s in samples:
        if s.name in (VLLM_PER_POS, VLLM_PER_POS + "_total") and s.labels.get("position", "").isdigit():
            pos = int(s.labels["position"])
            out[pos] = out.get(pos, 0.0) + s.value
    return out


def _vllm(before: Sequence[Sample], after: Sequence[Sample]) -> Served:
    names = (VLLM_DRAFTS, VLLM_ACCEPTED)
    got = {n: (_counter(before, n), _counter(after, n)) for n in names + (VLLM_DRAFT_TOKENS,)}
    if any(a is None for n in names for a in got[n]):
        return Served(f"{NO_COUNTERS} (vLLM without {VLLM_DRAFTS}: speculative decoding is off)")
    drafts = got[VLLM_DRAFTS][1] - got[VLLM_DRAFTS][0]
    accepted = got[VLLM_ACCEPTED][1] - got[VLLM_ACCEPTED][0]
    b_tok, a_tok = got[VLLM_DRAFT_TOKENS]
    draft_tokens = None if b_tok is None or a_tok is None else a_tok - b_tok
    if drafts <= 0:
        return Served(f"{NO_COUNTERS} (vLLM's {VLLM_DRAFTS} did not move during the level)")
    pb, pa = _per_pos(before), _per_pos(after)
    rates = [(pa[i] - pb.get(i, 0.0)) / drafts for i in sorted(pa)]
    k = len(rates) or (round(draft_tokens / drafts) if draft_tokens else None)
    return Served("vLLM counters (spec_decode_num_drafts, _accepted_tokens, _accepted_tokens_per_pos)",
                  1.0 + accepted / drafts, rates, k, drafts, accepted, draft_tokens)


def _sglang(after: Sequence[Sample], k: int | None) -> Served:
    values = [s.value for s in after if s.name == SGLANG_ACCEPT_LENGTH and math.isfinite(s.value)]
    if not values:
        return Served(f"{NO_COUNTERS} (SGLang without {SGLANG_ACCEPT_LENGTH})")
    tau = sum(values) / len(values)  # one gauge per scheduler (tp/dp rank): their mean
    if tau < 1.0:
        return Served(f"{NO_COUNTERS} (SGLang reports {SGLANG_ACCEPT_LENGTH} {tau:g}: speculative decoding is off)")
    return Served("SGLang gauge spec_accept_length (its last log interval, not cumulative)", tau, [], k)


def acceptance(engine: str | None, before: Sequence[Sample] | None, after: Sequence[Sample] | None,
               k: int | None = None) -> Served:
    """Acceptance over a level from the scrapes around it (see the module docstring)."""
    if before is None or after is None:
        return Served(f"{NO_COUNTERS} (the server has no Prometheus /metrics)")
    if engine == "vllm":
        return _vllm(before, after)
    if engine == "sglang":
        return _sglang(after, k)
    return Served(f"{NO_COUNTERS} (the metrics are neither vLLM's nor SGLang's)")
