"""Bench and served records: the committed raw files (most are version 1, written before
``outrider.records``) still read, migrated; what a writer stamps reads back; bad records are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outrider.errors import UserError
from outrider.records import VERSION, new_record, read_records, record_of, records_of, write_records
from outrider.trees import StaticTree, TreeBudget

ROOT = Path(__file__).resolve().parents[1]


def _record_files() -> list[Path]:
    """Every committed JSON file under benchmarks/results that holds bench or served records."""
    out = []
    for path in sorted((ROOT / "benchmarks" / "results").rglob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, list) and data and all(isinstance(r, dict) and "method" in r and "tau" in r for r in data):
            out.append(path)
    return out


RAW = _record_files() + [Path(__file__).parent / "data" / "h100-tree-4-4-16.json"]


def test_the_committed_raw_files_are_found():
    kinds = {"served" if "served" in str(p) else "bench" for p in RAW}
    assert len(RAW) >= 8 and kinds == {"bench", "served"}
    unversioned = [p for p in RAW if all("version" not in r for r in json.loads(p.read_text()))]
    assert len(unversioned) >= 8  # the migration from version 1 is exercised on real files


@pytest.mark.parametrize("path", RAW, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_records_still_read(path):
    raw = json.loads(path.read_text())
    records = read_records(path)
    assert len(records) == len(raw)
    for r, old in zip(records, raw):
        assert old.get("version", 1) in (1, VERSION)  # version 1: written before the records module
        assert r["version"] == VERSION and r.kind == ("served" if old.get("kind") == "served" else "bench")
        assert r.method == old["method"] and r.k == old.get("k") and r.date == old.get("date")
        assert r.tau == old["tau"] and list(r.accept_rate_per_pos) == (old.get("accept_rate_per_pos") or [])
        assert {key: r[key] for key in old} == old  # every key as written, unchanged


def test_a_tree_record_reads_its_tree():
    (r,) = read_records(Path(__file__).parent / "data" / "h100-tree-4-4-16.json")
    assert r.tree == TreeBudget(4, 4, 16) and r.k == 4 and r.device == "NVIDIA H100 80GB HBM3"
    static = record_of({"method": "eagle3", "k": 2, "tau": 2.0, "tree_paths": "[(0,), (1,), (0, 0)]"}, "t")
    assert isinstance(static.tree, StaticTree) and static.tree.shape() == (2, 2, 4)
    assert record_of({"method": "eagle3", "k": 3, "tau": 2.0}, "t").tree is None


def test_what_a_writer_stamps_reads_back(tmp_path):
    fields = {"method": "eagle3", "k": 3, "tau": 2.5, "accept_rate_per_pos": [0.8, 0.5, 0.2], "tokens_per_s": 10.0,
              "speedup_vs_ar": 1.4, "device": "cpu", "date": "2026-12-06", "git_commit": "abc"}
    written = new_record("bench", fields)
    assert list(written)[:len(fields)] == list(fields) and written["kind"] == "bench" and written["version"] == VERSION
    write_records(tmp_path / "r.json", [written])
    (r,) = read_records(tmp_path / "r.json")
    assert r.to_json() == written and dict(r) == written
    assert (r.method, r.k, r.tau, r.accept_rate_per_pos, r.speedup_vs_ar) == ("eagle3", 3, 2.5, (0.8, 0.5, 0.2), 1.4)
    served = new_record("served", {"kind": "served", "method": "eagle3", "tau": None})
    assert list(served) == ["kind", "method", "tau", "version"] and record_of(served, "s").served


@pytest.mark.parametrize("record, says", [
    ({"k": 3, "tau": 2.0}, "no 'method'"),
    ({"method": "eagle3", "tau": "x"}, "'tau' must be a number"),
    ({"method": "eagle3", "k": "3"}, "'k' must be an integer"),
    ({"method": "eagle3", "accept_rate_per_pos": "0.5"}, "list of numbers"),
    ({"method": "eagle3", "version": VERSION + 1}, "update outrider"),
    ({"method": "eagle3", "kind": "plan", "version": VERSION}, "'kind'"),
    ({"method": "eagle3", "topk": 2, "steps": 3, "draft_tokens": 12}, "draft_tokens 12 is impossible"),
])
def test_bad_records_are_one_line_errors(record, says):
    with pytest.raises(UserError) as e:
        records_of([record], "f.json")
    assert says in str(e.value) and "f.json: record 0" in str(e.value) and "\n" not in str(e.value)


def test_file_shapes():
    one = {"method": "ngram", "k": 3, "tau": 1.5}
    assert len(records_of(one, "f")) == 1 and len(records_of({"records": [one, one]}, "f")) == 2
    assert records_of([], "f") == []
    with pytest.raises(UserError, match="expected a list of bench records"):
        records_of({"stages": []}, "f")
