"""One line per k for each ``walk-*.json`` that ``walk_check.py --out`` wrote into a folder.

    python benchmarks/walk_table.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        print("usage: python benchmarks/walk_table.py DIR (a folder of walk_check outputs)", file=sys.stderr)
        return 2
    for f in sorted(Path(sys.argv[1]).glob("walk-*.json")):
        r = json.loads(f.read_text())
        for k, s in r["by_k"].items():
            print(f"{f.stem}: k={k} walked tau {s['walked_tau']:.3f} over {r['examples']} texts, step-0 accuracy "
                  f"{r['step0_acc_all_positions']:.3f}, repeated 4-grams {r['repeated_4grams']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
