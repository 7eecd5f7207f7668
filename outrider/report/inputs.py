"""What ``outrider report`` reads: each path recognised as a training run, bench records, a plan's
rows, a training plan or a demo folder, with where every record came from.

Contract: ``load(paths)`` returns ``Inputs``; every record keeps its ``Source`` (the file, its
kind, the device, date and commit it states: ``None`` where the record does not say). Recognised:
- a training run folder (``metrics.jsonl``, ``train_config.json``; ``outrider train --out``) or a
  ``metrics.jsonl`` (``.gz``) file itself. A line that is not a JSON object is refused (one line
  naming file and line), except the last line, which a run killed mid-write leaves cut: it is
  skipped and a note says so;
- bench records (``outrider bench --json``: a list of objects with ``method`` and ``tau``, read by
  ``outrider.records``), served ones among them (``bench --server``: ``kind: served``, a record per
  concurrency);
- a plan's rows (``outrider plan --json``: objects with ``method``, ``k``, ``batch``, ``speedup``);
- a training plan (``outrider plan --train --json``: an object with ``stages`` and ``sizes``);
- a demo folder (``outrider demo --out``): its ``train/`` run and its ``bench.json``.
Anything else (a missing path, an empty folder, a folder or file of another kind) is a one-line
``UserError``. Nothing here draws or formats.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outrider.errors import UserError
from outrider.outputs import kind_of
from outrider.records import records_of

KINDS = "a training run folder, bench records, a plan's or a training plan's JSON, or a demo folder"


@dataclass(frozen=True)
class Source:
    """One input file and what it states about where its numbers came from."""

    index: int  # its number on the page: [index]
    path: str
    kind: str  # "training run", "bench", "plan", "training plan"
    device: str | None
    date: str | None
    commit: str | None
    date_from_file: bool = False  # the record names no date: the file's modification date is shown

    def cite(self) -> str:
        date = (self.date or "?") + (" (file)" if self.date_from_file else "")
        device, commit = self.device or "device not recorded", self.commit or "commit not recorded"
        return f"[{self.index}] {device} · {date} · {commit}"


@dataclass
class Run:
    source: Source
    train: list[dict[str, Any]]  # the ``type: train`` rows, in order
    evals: list[dict[str, Any]]  # the ``type: eval`` rows
    config: dict[str, Any]  # train_config.json ({} when absent)


@dataclass
class Inputs:
    runs: list[Run] = field(default_factory=list)
    bench: list[tuple[dict[str, Any], Source]] = field(default_factory=list)
    served: list[tuple[dict[str, Any], Source]] = field(default_factory=list)  # ``bench --server``, per concurrency
    plans: list[tuple[list[dict[str, Any]], Source]] = field(default_factory=list)
    train_plans: list[tuple[dict[str, Any], Source]] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def source(self, path: Path, kind: str, device: Any, date: Any, commit: Any) -> Source:
        """The source of a record (one already listed when file, kind, device, date and commit agree)."""
        when = str(date) if date else None
        src = Source(len(self.sources) + 1, str(path), kind, str(device) if device else None,
                     when or _file_date(path), str(commit) if commit else None, date_from_file=not when)
        same = [s for s in self.sources if (s.path, s.kind, s.device, s.date, s.commit) ==
                (src.path, src.kind, src.device, src.date, src.commit)]
        if same:
            return same[0]
        self.sources.append(src)
        return src


def _file_date(path: Path) -> str:
    stamp = path.stat().st_mtime
    return _dt.datetime.fromtimestamp(stamp, _dt.timezone.utc).strftime("%Y-%m-%d")


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
        return (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {' '.join(str(e).split())[:160]}") from None


def metrics_rows(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The rows of a ``metrics.jsonl``, and a note when its cut last line was skipped."""
    lines = _read_text(path).splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    rows, note = [], None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("type"), str) and isinstance(row.get("step"), int):
            if row["type"] in ("train", "eval"):  # other records (a resume's changes) are not curves
                rows.append(row)
        elif n == len(lines):
            note = f"{path}: its last line (line {n}) is cut short, as a run killed mid-write leaves it: skipped"
        else:
            raise UserError(f"{path} line {n} is not a metrics record (a JSON object with type and step): "
                            "the file is damaged or not an outrider metrics.jsonl")
    if not rows:
        raise UserError(f"{path} holds no training step yet: nothing to report")
    return rows, note


def _json(path: Path) -> Any:
    text = _read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): expected {KINDS}") from None


def _is_records(data: Any, *keys: str) -> bool:
    return isinstance(data, list) and bool(data) and all(isinstance(r, dict) and all(k in r for k in keys)
                                                         for r in data)


def _add_run(inputs: Inputs, folder: Path, metrics: Path) -> None:
    rows, note = metrics_rows(metrics)
    config: dict[str, Any] = {}
    cfg_path = folder / "train_config.json"
    if cfg_path.is_file():
        try:
            loaded = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{cfg_path} is not valid JSON ({e}): the run folder is damaged") from None
        config = loaded if isinstance(loaded, dict) else {}
    if note:
        inputs.notes.append(note)
    src = inputs.source(metrics, "training run", config.get("device_name") or config.get("device"),
                        config.get("date"), config.get("git_commit"))
    inputs.runs.append(Run(src, [r for r in rows if r["type"] == "train"], [r for r in rows if r["type"] == "eval"],
                           config))


def _add_file(inputs: Inputs, path: Path) -> None:
    if path.name.startswith("metrics.jsonl"):
        _add_run(inputs, path.parent, path)
        return
    data = _json(path)
    if isinstance(data, dict) and isinstance(data.get("records"), list):
        data = data["records"]
    if isinstance(data, dict) and "method" in data and "tau" in data:
        data = [data]
    if _is_records(data, "method", "tau"):
        for r in records_of(data, str(path)):
            device = f"{r.get('engine', '?')} {r.get('engine_version') or ''} at {r.get('server', '?')}" if r.served \
                else r.device
            src = inputs.source(path, r.kind, device, r.date, r.git_commit)
            (inputs.served if r.served else inputs.bench).append((r, src))
    elif _is_records(data, "method", "k", "batch", "speedup"):
        first = data[0]
        inputs.plans.append((data, inputs.source(path, "plan", _plan_device(first), first.get("date"),
                                                 first.get("git_commit"))))
    elif isinstance(data, dict) and isinstance(data.get("stages"), list) and "sizes" in data:
        device = f"{data.get('gpus', '?')} x {data.get('hardware', '?')} (planned)"
        inputs.train_plans.append((data, inputs.source(path, "training plan", device, data.get("date"),
                                                       data.get("git_commit"))))
    else:
        raise UserError(f"{path} is none of what report reads: expected {KINDS}")


def _plan_device(row: dict[str, Any]) -> str | None:
    hw = row.get("hardware")
    if not hw:
        return None
    return f"{row.get('tp', 1)} x {hw} (predicted)"


def _add_folder(inputs: Inputs, folder: Path) -> None:
    names = [p.name for p in folder.iterdir() if not p.name.startswith(".")]
    if not names:
        raise UserError(f"{folder} is an empty folder: expected {KINDS}")
    for metrics in ("metrics.jsonl", "metrics.jsonl.gz"):
        if (folder / metrics).is_file():
            _add_run(inputs, folder, folder / metrics)
            return
    if kind_of(folder) == "demo" or (folder / "bench.json").is_file():
        found = False
        if (folder / "train" / "metrics.jsonl").is_file():
            _add_run(inputs, folder / "train", folder / "train" / "metrics.jsonl")
            found = True
        for name in ("bench.json", "plan.json", "plan-train.json"):
            if (folder / name).is_file():
                _add_file(inputs, folder / name)
                found = True
        if found:
            return
    raise UserError(f"{folder} holds no training run (metrics.jsonl), bench.json or demo output: expected {KINDS}")


def load(paths: list[str]) -> Inputs:
    """Every path recognised (see the module docstring), in the order given."""
    if not paths:
        raise UserError(f"nothing to report: give {KINDS}")
    inputs = Inputs()
    for given in paths:
        path = Path(given).expanduser()
        if path.is_dir():
            _add_folder(inputs, path)
        elif path.is_file():
            _add_file(inputs, path)
        else:
            raise UserError(f"{given} does not exist: expected {KINDS}")
    return inputs
