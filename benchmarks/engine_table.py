"""The "Served by vLLM (CPU)" table of RESULTS.md from the engine tier's records.

    OUTRIDER_ENGINE_OUT=DIR python -m pytest -m engine tests/test_engine_vllm.py
    python benchmarks/engine_table.py DIR

Each ``DIR/NAME.json`` is one `bench --server` record list (one level, c = 1): served tau from
vLLM's counters, the offline tau (walked, and counted as the engine counts), outputs equal to
ours, the served-vs-offline verdict.
"""

from __future__ import annotations

import sys
from pathlib import Path

from outrider.records import read_records


def fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main(folder: str) -> None:
    print("| case | served tau | offline tau (engine's count / walked) | difference | outputs = ours | flagged | tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path in sorted(Path(folder).glob("*.json")):
        (r,) = read_records(path, "served records")
        v = r.get("served_vs_offline") or {}
        rel = v.get("relative_difference")
        print(f"| {path.stem} | {fmt(r.get('tau'))} | {fmt(r.get('offline_uncut_tau'))} / {fmt(r.get('offline_tau'))} "
              f"| {'-' if rel is None else f'{100 * rel:+.1f} %'} | {r.get('outputs_equal_local')} of {r['completed']} "
              f"| {'yes' if v.get('flagged') else ('no' if v else '-')} | {fmt(r.get('tokens_per_s'), 1)} |")


if __name__ == "__main__":
    main(sys.argv[1])
