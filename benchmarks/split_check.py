"""How much of a token dataset's eval text its train split already holds, token for token.

    python benchmarks/split_check.py --data DIR [--write-by-example DIR2] [--out F]
    python benchmarks/split_check.py --demo-proxy full --work DIR [--out F]

An eval example whose first part is a train example's (the same prompt, and with greedy
regeneration the same reply; the demo's later exchanges open with their conversation's first) can be
recalled by a head trained for several epochs, so the trainer's walked tau on the eval split reads
higher than what the head drafts on new prompts. ``split_overlap`` (``outrider.train.data.datasets``)
counts, for each eval example, the learned tokens inside the longest prefix it shares with a train
example, and the eval examples whose opening prompt a train example has.

``--data``: the dataset's own split, and the same examples split one by one in the seeded
permutation of the examples one by one (how datasets were split before the split kept openings together);
``--write-by-example DIR2`` writes that second split as a dataset, to train a head on it.

``--demo-proxy PRESET``: no regeneration (a CPU can't regenerate the full preset's replies in
minutes): the preset's exchanges (``sharegpt.training_exchanges``) with each source reply cut to the
preset's regeneration length are tokenised into ``--work``/data (the demo's max length, eval fraction
and seed), and both splits are measured on them. The shared prefixes are the ones regeneration
makes (a later exchange starts with its conversation's first), the reply lengths only close to them.

Prints one line per split and a final JSON line; exit status 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from outrider import assets, sharegpt
from outrider.demo import SIZES
from outrider.errors import UserError
from outrider.fsutil import atomic_write_json
from outrider.models import load_tokenizer
from outrider.train.data.datasets import (TokenDataset, load_dataset, opening, read_manifest, split_overlap,
                                          write_dataset)
from outrider.train.data.prepare import build_dataset


def by_example(data: str) -> tuple[TokenDataset, TokenDataset]:
    """The dataset's examples (train, then eval) split one by one as before openings were kept
    together: eval = the first ``round(eval_fraction * n)`` of a seeded permutation."""
    manifest = read_manifest(data)
    parts = [load_dataset(data, s) for s in ("train", "eval")]
    ids = [x for p in parts for x in p.input_ids]
    masks = [m for p in parts for m in p.loss_mask]
    convs = [c for p in parts for c in p.conv_ids]
    n = len(ids)
    n_eval = min(max(int(round(float(manifest["eval_fraction"]) * n)), 1), n - 1)
    held = set(int(i) for i in np.random.default_rng(int(manifest["seed"])).permutation(n)[:n_eval])

    def pick(inside: bool, split: str) -> TokenDataset:
        keep = [i for i in range(n) if (i in held) == inside]
        return TokenDataset([ids[i] for i in keep], [masks[i] for i in keep], [convs[i] for i in keep],
                            manifest, split)

    return pick(False, "train"), pick(True, "eval")


def proxy_data(preset: str, work: Path) -> str:
    """The preset's exchanges, source replies cut to its regeneration length, tokenised (no regeneration)."""
    if preset not in SIZES:
        raise UserError(f"--demo-proxy takes one of {', '.join(SIZES)}, got {preset!r}")
    size = SIZES[preset]
    data = work / "data"
    if (data / "manifest.json").exists():
        return str(data)
    tokenizer = load_tokenizer("default")
    corpus = sharegpt.load_sharegpt(assets.sharegpt_path(pulled=True))
    exchanges = sharegpt.training_exchanges(corpus, size.first, size.later, size.single)
    for ex in exchanges:
        for turn in ex["conversations"]:
            if turn.get("from") == "gpt":
                ids = tokenizer(turn.get("value") or "", add_special_tokens=False)["input_ids"]
                turn["value"] = tokenizer.decode(ids[:size.regen_tokens])
    work.mkdir(parents=True, exist_ok=True)
    source = work / "exchanges.json"
    atomic_write_json(source, exchanges)
    build_dataset("default", str(source), str(data), max_length=size.max_length, progress=True)
    return str(data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a token dataset folder")
    src.add_argument("--demo-proxy", metavar="PRESET", help="the demo preset's exchanges, not regenerated")
    ap.add_argument("--work", help="with --demo-proxy: where its dataset is written (reused when there)")
    ap.add_argument("--write-by-example", metavar="DIR2", help="write the one-by-one split as a dataset here")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    try:
        if a.demo_proxy and not a.work:
            raise UserError("--demo-proxy needs --work DIR for its dataset")
        data = proxy_data(a.demo_proxy, Path(a.work)) if a.demo_proxy else a.data
        manifest = read_manifest(data)
        rows = {"own": (load_dataset(data, "train"), load_dataset(data, "eval")), "by_example": by_example(data)}
        if a.write_by_example:
            train, held = rows["by_example"]
            write_dataset(Path(a.write_by_example), {**manifest, "split_by": "example", "splits": {},
                                                     "counts": {**manifest["counts"], "train": len(train),
                                                                "eval": len(held)}},
                          {s.split: [(c, i.tolist(), m.tolist()) for i, m, c in zip(s.input_ids, s.loss_mask,
                                                                                   s.conv_ids)]
                           for s in (train, held)}, shard_rows=8192)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result: dict = {"data": data, "split_by": manifest.get("split_by", "example"), "splits": {}}
    for name, (train, held) in rows.items():
        r = split_overlap(train, held)
        r["openings"] = len({opening(i, m) for i, m in zip(held.input_ids, held.loss_mask)})
        result["splits"][name] = r
        print(f"{name:>10}: {r['examples']} eval examples, {r['shared_openings']} open as a train example does, "
              f"{r['seen_examples']} share learned tokens with one; {r['seen_share']:.1%} of "
              f"{r['loss_tokens']} learned eval tokens inside a prefix a train example has")
    if a.out:
        atomic_write_json(Path(a.out), result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
