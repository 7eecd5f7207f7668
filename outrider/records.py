"""Bench and served records: the measurement every writer writes and every reader reads, typed, versioned.

Contract: a record is one measurement of one method: ``kind`` ``"bench"`` (``outrider bench``: our
engine against our autoregressive baseline) or ``"served"`` (one concurrency level of an external
engine, ``outrider bench --server``). Its JSON form is a flat object with the keys DESIGN.md's CLI
contract lists (``method``, ``k`` or the tree, ``tau``, ``accept_rate_per_pos``, ``tokens_per_s``,
``speedup_vs_ar``, the verdict, ``device``, ``dtype``, ``date``, ``git_commit``, ...) plus ``kind``
and ``version``. Writers stamp their fields with ``new_record(kind, fields)`` and write lists with
``write_records``; readers take ``read_records(path, what)`` (``records_of(data, origin)`` for JSON
already read): ``Record``s migrated to ``VERSION`` and checked (the typed fields' types, the tree's
shape: one line naming the file and the record), with typed attributes for what every reader uses
and, as a read-only mapping, every key as written.

Versions: 1, the records written before this module (no ``version``; bench records without
``kind``, told from served ones by ``kind: "served"``); 2, ``version`` and ``kind`` in every record.
A record of a later version than ``VERSION`` is refused. Files hold a list of records (what bench
writes), one record, or ``{"records": [...]}``.

Not done here: what a reader makes of a record (``plan``, ``report``), measuring (``bench``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outrider.errors import UserError
from outrider.fsutil import read_json, write_json_output
from outrider.trees import TreeSpec, tree_of

VERSION = 2
KINDS = ("bench", "served")


@dataclass(frozen=True)
class Record(Mapping):
    """One record, read: the fields every reader uses, typed, and every key as written (``fields``,
    also reached as a mapping: ``r["verdict"]``, ``r.get("near_ties")``)."""

    kind: str  # "bench" or "served"
    method: str
    k: int | None  # a chain's draft tokens per step; a tree's steps (its depth); None: not given
    tree: TreeSpec | None  # the tree drafted (``outrider.trees``); None: a chain or plain decoding
    tau: float | None  # tokens per target forward, bonus included; None: not measured (no counters)
    accept_rate_per_pos: tuple[float, ...]
    tokens_per_s: float | None
    speedup_vs_ar: float | None
    device: str | None
    date: str | None
    git_commit: str | None
    fields: dict[str, Any] = field(repr=False)  # every key, migrated to ``VERSION``

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    @property
    def served(self) -> bool:
        return self.kind == "served"

    def to_json(self) -> dict[str, Any]:
        return dict(self.fields)


def new_record(kind: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """A writer's record: ``fields`` (the keys written today, in their order) stamped with ``kind``
    and ``version``."""
    if kind not in KINDS:
        raise ValueError(f"record kind {kind!r}: one of {', '.join(KINDS)}")
    return {**fields, "kind": kind, "version": VERSION}


def write_records(path: str | Path, records: list[Mapping[str, Any]]) -> Path | None:
    """``--json F`` of a list of records (``fsutil.write_json_output``: ``-`` is standard output)."""
    return write_json_output(path, [dict(r) for r in records])


def migrate(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A record's JSON object, of any version, as version ``VERSION`` writes it."""
    version = data.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise UserError(f"{where}: 'version' must be an integer >= 1, got {version!r}")
    if version > VERSION:
        raise UserError(f"{where}: a version {version} record; this outrider reads versions up to {VERSION}: "
                        "update outrider")
    out = dict(data)
    if version == 1:  # no kind: a bench record unless it says served
        out["kind"] = "served" if data.get("kind") == "served" else "bench"
        out["version"] = 2
    return out


def _number(r: Mapping[str, Any], key: str, where: str) -> float | None:
    v = r.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise UserError(f"{where}: '{key}' must be a number, got {v!r}")
    return float(v)


def _text(r: Mapping[str, Any], key: str) -> str | None:
    v = r.get(key)
    return None if v is None else str(v)


def record_of(data: Any, where: str) -> Record:
    """One record's JSON object -> a checked ``Record`` (``UserError`` naming ``where``)."""
    if not isinstance(data, Mapping):
        raise UserError(f"{where}: a record is a JSON object, got {type(data).__name__}")
    r = migrate(data, where)
    if r["kind"] not in KINDS:
        raise UserError(f"{where}: 'kind' {r['kind']!r} is none of {', '.join(KINDS)}")
    method = r.get("method")
    if not isinstance(method, str) or not method:
        raise UserError(f"{where}: the record has no 'method'")
    k = r.get("k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise UserError(f"{where}: 'k' must be an integer >= 0, got {k!r}")
    rates = r.get("accept_rate_per_pos") or []
    if not isinstance(rates, list) or any(isinstance(a, bool) or not isinstance(a, (int, float)) for a in rates):
        raise UserError(f"{where}: 'accept_rate_per_pos' must be a list of numbers, got {rates!r}")
    return Record(r["kind"], method, k, tree_of(r, where), _number(r, "tau", where), tuple(float(a) for a in rates),
                  _number(r, "tokens_per_s", where), _number(r, "speedup_vs_ar", where), _text(r, "device"),
                  _text(r, "date"), _text(r, "git_commit"), r)


def records_of(data: Any, origin: str) -> list[Record]:
    """The records of a file's JSON (a list, one record, or ``{"records": [...]}``); ``origin``
    names the file in errors."""
    if isinstance(data, Mapping) and isinstance(data.get("records"), list):
        data = data["records"]
    if isinstance(data, Mapping) and "method" in data:
        data = [data]
    if not isinstance(data, list) or not all(isinstance(r, Mapping) for r in data):
        raise UserError(f"{origin}: expected a list of bench records (JSON objects), as `outrider bench --json` writes")
    return [record_of(r, f"{origin}: record {i}") for i, r in enumerate(data)]


def read_records(path: str | Path, what: str = "bench records") -> list[Record]:
    """The records in the JSON file ``path`` (``what`` it should hold names it in errors)."""
    return records_of(read_json(path, what), str(path))
