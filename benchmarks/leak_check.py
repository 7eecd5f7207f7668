"""Whether benchmark prompts occur in a token dataset's text: a leak makes acceptance look better.

    python benchmarks/leak_check.py --data DIR --prompts SRC [--target default] [--out F]

Every example of the dataset (each ``*.parquet`` shard of DIR, train and eval splits) is decoded
with the target's tokenizer, case and whitespace folded (``sharegpt.prompt_key``), and searched for
each prompt of SRC (as ``outrider bench`` takes them). Per prompt, examples counted:

- ``turn``: the whole prompt as a whole turn (a special token follows it): the target's reply to
  that very prompt may be in the data, a leak;
- ``prefix``: for a prompt of at least ``sharegpt.PREFIX_CHARS`` folded characters, those first
  characters (``sharegpt.prompt_prefix``: the same task cut short or extended), a leak;
- ``inside``: the prompt inside a longer text ("write a python script" inside "write a python
  script to send an email"), shown and not counted as a leak.

Prints one line per prompt found and a final JSON line; exit status 1 when any prompt leaks, 0
when none does, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from outrider import sharegpt
from outrider.bench.local import prompt_texts
from outrider.errors import UserError
from outrider.fsutil import atomic_write_json
from outrider.models import load_tokenizer


def _texts(directory: Path, tokenizer):
    """Yield the folded text of every example of every shard under ``directory``."""
    import pyarrow.parquet as pq

    shards = sorted(directory.glob("*.parquet"))
    if not shards:
        raise UserError(f"{directory}: no *.parquet shards (a folder written by `outrider prepare`?)")
    for shard in shards:
        ids = pq.read_table(shard, columns=["input_ids"]).column("input_ids").to_pylist()
        for text in tokenizer.batch_decode(ids):
            yield sharegpt.prompt_key(text)


def leak_counts(prompts: list[str], texts, specials: list[str]) -> tuple[list[dict[str, int]], int]:
    """Per prompt the counts of examples with it as a whole turn, by its prefix, inside a longer text."""
    keys = [sharegpt.prompt_key(p) for p in prompts]
    prefixes = [sharegpt.prompt_prefix(k) for k in keys]
    folded_specials = [s.casefold() for s in specials]
    counts = [{"turn": 0, "prefix": 0, "inside": 0} for _ in prompts]
    n = 0
    for text in texts:
        n += 1
        for key, prefix, c in zip(keys, prefixes, counts):
            at = text.find(key)
            whole = False
            while at >= 0 and not whole:
                rest = text[at + len(key):].lstrip()
                whole = any(rest.startswith(s) for s in folded_specials)
                at = text.find(key, at + 1)
            c["turn"] += whole
            c["prefix"] += prefix is not None and not whole and prefix in text
            c["inside"] += not whole and key in text and not (prefix is not None and prefix in text)
    return counts, n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="a token dataset folder (its *.parquet shards)")
    p.add_argument("--prompts", required=True, help="'sharegpt', a .txt or a .json list of prompts")
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--target", default="default", help="whose tokenizer wrote the dataset")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        prompts = prompt_texts(a.prompts, a.num_prompts)
        tokenizer = load_tokenizer(a.target)
        counts, n = leak_counts(prompts, _texts(Path(a.data), tokenizer), list(tokenizer.all_special_tokens))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    leaked = [i for i, c in enumerate(counts) if c["turn"] or c["prefix"]]
    for i, (prompt, c) in enumerate(zip(prompts, counts)):
        if any(c.values()):
            tag = "LEAK" if i in leaked else "ok  "
            print(f"{tag} prompt {i}: turn {c['turn']}, prefix {c['prefix']}, inside {c['inside']}: "
                  f"{' '.join(prompt.split())[:70]!r}")
    result = {"data": a.data, "prompts": a.prompts, "num_prompts": len(prompts), "examples": n,
              "leaked": leaked, "counts": counts}
    if a.out:
        atomic_write_json(Path(a.out), result)
    print(json.dumps(result))
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())
