"""The demo's two kinds of training prompt as prompt files that ``outrider bench --prompts`` takes.

    python benchmarks/prompt_kinds.py --out DIR [--num 30]

Writes ``DIR/first.json`` (the user turns that open training-split conversations) and
``DIR/single.json`` (user turns from further in, each alone), ``--num`` of each, picked as the
demo's data stage picks them (``sharegpt.training_exchanges``, from the pulled ShareGPT file). The
bench's own prompts (``--prompts sharegpt``) are first turns of held-out conversations, so benching
one method on the three sets tells how much a prompt's kind, rather than the drafter, moves its tau.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from outrider import assets, sharegpt
from outrider.errors import UserError
from outrider.fsutil import atomic_write_json


def kinds(num: int) -> dict[str, list[str]]:
    """``num`` first-exchange prompts and ``num`` single prompts, in the demo's order."""
    corpus = sharegpt.load_sharegpt(assets.sharegpt_path(pulled=True))
    picked = sharegpt.training_exchanges(corpus, first=num, single=num)
    out: dict[str, list[str]] = {"first": [], "single": []}
    for ex in picked:
        out["single" if "#s" in ex["id"] else "first"].append(ex["conversations"][0].get("value") or "")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, default=30)
    a = ap.parse_args()
    try:
        if a.num < 1:
            raise UserError(f"--num must be >= 1, got {a.num}")
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        for kind, texts in kinds(a.num).items():
            atomic_write_json(out / f"{kind}.json", texts)
            print(f"{out / f'{kind}.json'}: {len(texts)} prompts")
    except UserError as e:
        print(f"prompt_kinds: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
