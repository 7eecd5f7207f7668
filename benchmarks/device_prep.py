"""Stage what a device session needs, here, in git-ignored folders that each fit one call's carry.

    python benchmarks/device_prep.py [--first 11000] [--later 12000] [--deeper 7000] [--prompts 30]

The lent machine starts bare (no network, no model hub) and takes at most 64 MiB of working tree
per call; the default model's GGUF (98 MB) therefore travels in two calls. Writes:

- ``.dev/b1``: the GGUF's first 57.5 MB and ``prompts-heldout.json`` (the held-out split's first user
  turns, the benchmark prompts); ``.whl``: the wheels the machine lacks (``gguf``, ``pytest``).
- ``.dev/b2``: the rest of the GGUF (41 MB: with ``.dev/r``'s merged data it fits one call).
- ``.dev/b3``: ``first-exchanges.json.gz`` (the first user turn and reply of training-split
  conversations, as the demo builds them) and ``later-exchanges.json.gz``: second exchanges with the
  first one as context (both replies are regenerated), then single exchanges of conversation parts
  that open with a reply.
- ``.dev/b4``: ``deeper-exchanges.json.gz``: the first ``--deeper`` of the third, then fourth, then
  fifth exchanges, the earlier ones as context (``deeper.sh`` regenerates every reply and merges them
  after the first and later ones); ``.dev/b5``: the rest of them (``SRC=b5``, merged after those).
- ``.dev/commit``: the commit the calls run (``OUTRIDER_COMMIT`` on the device): run this after the last commit.

The calls, in order (scripts of ``benchmarks/device/``; each one's header says what it does):

1. ``bash benchmarks/device/stage.sh``, carry ``.dev/b1 .whl .dev/commit``;
2. within 30 s: ``bash benchmarks/device/model.sh && bash benchmarks/device/data.sh``, carry
   ``.dev/b2 .dev/b3 .dev/commit`` (~62 MiB with the checkout); then ``bash benchmarks/device/deeper.sh``,
   carry ``.dev/b4 .dev/commit`` (``SRC=b5 BASE=data-all2 MERGED=data-all3`` for the rest); and/or
   ``bash benchmarks/device/sampled.sh``, carry ``.dev/b3 .dev/commit``: the first exchanges' replies
   sampled at ``TEMP`` (0.7) and merged after ``BASE`` (data-all3, into data-all4);
3. ``BUDGET=450 DATA=data-all2 bash benchmarks/device/train.sh``; 4. ``bash benchmarks/device/bench.sh``.

A machine left idle for 30 s is taken back with everything under /tmp, and a reply to a long
call can take longer than that: the data and the head come back under ``$OUT`` in parts under
the 16 MiB a returned file may have (``data.tgz.NN``, ``later/data-all.tgz.NN``, ``data-all2.tgz.NN``,
``head.tar.NN``);
copied into ``.dev/r``, they are put back by ``restore.sh`` (carry ``.dev/r``) after a fresh
``stage.sh`` and ``model.sh``. ``DEV=cpu`` runs the same scripts on a machine without
a GPU (float32, with e.g. ``FIRST=6 LATER=6``, a tiny ``SETTINGS``, ``PASSES=eager:eagle3 NUM=1``):
a dry run of a session's calls that costs no device time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

from outrider import assets, sharegpt
from outrider.demo import _first_exchanges
from outrider.fsutil import atomic_write_json

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ("gguf", "pytest", "pluggy", "iniconfig")
PART = 57_500_000  # bytes of the GGUF in the first call: the rest, with the data, fits the second


def later_exchanges(corpus, limit: int) -> list[dict]:
    """Training-split exchanges after the first: turns 1-4 of conversations that have them, then the
    first exchange of conversation parts that open with a reply (their earlier turns are elsewhere)."""
    held = sharegpt.held_out_filter(corpus.conversations)
    out = []
    for conv in corpus.conversations:
        turns = conv.get("conversations") or []
        who = [t.get("from") for t in turns]
        if held(conv):
            continue
        if who[:4] == ["human", "gpt", "human", "gpt"]:
            out.append({"id": conv["id"] + "#2", "conversations": turns[:4]})
        elif who[:1] == ["gpt"] and "human" in who:
            i = who.index("human")
            if who[i + 1:i + 2] == ["gpt"]:
                out.append({"id": conv["id"] + "#p", "conversations": turns[i:i + 2]})
    return out[:limit]


def deeper_exchanges(corpus, exchanges=(3, 4, 5)) -> list[dict]:
    """Training-split exchanges deeper in a conversation: for each n in ``exchanges``, the first 2n
    turns of every conversation whose first 2n turns alternate human, gpt (``deeper.sh`` regenerates
    every reply in order, each the context of the next)."""
    held = sharegpt.held_out_filter(corpus.conversations)
    out = []
    for n in exchanges:
        for conv in corpus.conversations:
            turns = conv.get("conversations") or []
            if held(conv) or len(turns) < 2 * n:
                continue
            if all(t.get("from") == ("human", "gpt")[i % 2] for i, t in enumerate(turns[:2 * n])):
                out.append({"id": f"{conv['id']}#{n}", "conversations": turns[:2 * n]})
    return out


def _gz(path: Path, records) -> None:
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        json.dump(records, f)
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--first", type=int, default=11000, help="first exchanges")
    ap.add_argument("--later", type=int, default=12000, help="later exchanges")
    ap.add_argument("--deeper", type=int, default=7000, help="deeper exchanges in .dev/b4 (the rest: b5)")
    ap.add_argument("--prompts", type=int, default=30,
                    help="held-out benchmark prompts (bench.sh takes the first NUM, 10 by default)")
    a = ap.parse_args()
    dev = ROOT / ".dev"
    b1, b2, b3, b4, b5 = (dev / f"b{i}" for i in range(1, 6))
    whl = ROOT / ".whl"
    for d in (b1, b2, b3, b4, b5, whl):
        d.mkdir(parents=True, exist_ok=True)
    gguf = assets.default_gguf_path()
    data = gguf.read_bytes()
    (b1 / "gguf.part00").write_bytes(data[:PART])
    (b2 / "gguf.part01").write_bytes(data[PART:])
    corpus = sharegpt.load_sharegpt(assets.sharegpt_path(pulled=True))
    prompts = sharegpt.first_user_turns(corpus, heldout_only=True, limit=a.prompts)
    atomic_write_json(b1 / "prompts-heldout.json", prompts)
    first = _first_exchanges(corpus, a.first, dev / "first-exchanges.json")
    _gz(b3 / "first-exchanges.json.gz", json.loads(first.read_text()))
    first.unlink()
    later = later_exchanges(corpus, a.later)
    _gz(b3 / "later-exchanges.json.gz", later)
    deeper = deeper_exchanges(corpus)
    _gz(b4 / "deeper-exchanges.json.gz", deeper[:a.deeper])
    _gz(b5 / "deeper-exchanges.json.gz", deeper[a.deeper:])
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(whl), *WHEELS], check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    (dev / "commit").write_text(commit.stdout.strip() or "unknown")
    for d in (b1, b2, b3, b4, b5, whl):
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d.relative_to(ROOT)}: {size / 2**20:.1f} MiB")
    print(f"{len(prompts)} prompts, {a.first} first exchanges asked, {len(later)} later and "
          f"{len(deeper)} deeper exchanges; commit {(dev / 'commit').read_text()}")


if __name__ == "__main__":
    main()
