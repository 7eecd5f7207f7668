"""How fast the demo's data stage regenerates replies, by batch size.

    python benchmarks/regen_rate.py [--batches 128,256,512] [--prompts 1024] [--max-new 256] [--out F]

The prompts are the first ``--prompts`` single exchanges of the full demo preset
(``sharegpt.training_exchanges``: later user turns, each alone), rendered with the default model's
chat template as regeneration renders them; each batch size regenerates all of them greedily through
``demo.engine_generate_fn`` (CUDA graphs on a GPU), in waves of similar length, after one untimed
wave. Prints, per batch size, exchanges and new tokens per second; a final JSON line (``--out``
also writes it). Exit status 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from outrider import assets, sharegpt
from outrider.cliargs import POSITIVE, int_list
from outrider.decode.engine import eos_token_ids
from outrider.demo import SIZES, engine_generate_fn
from outrider.errors import UserError
from outrider.fsutil import atomic_write_json
from outrider.models import load_model
from outrider.train.data.template import encode, render


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int_list(1, what="batch sizes"), default=[128, 256, 512])
    ap.add_argument("--prompts", type=POSITIVE, default=1024)
    ap.add_argument("--max-new", type=POSITIVE, default=256)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    try:
        size = SIZES["full"]
        assets.pull(progress=False)
        model, tok = load_model("default")
        cuda = torch.cuda.is_available()
        corpus = sharegpt.load_sharegpt(assets.sharegpt_path(pulled=True))
        singles = sharegpt.training_exchanges(corpus, 0, 0, a.prompts)
        prompts = []
        for ex in singles:
            msgs = [{"role": "user", "content": ex["conversations"][0]["value"]}]
            ids = encode(tok, render(tok, msgs, True))
            if len(ids) < size.max_length:
                prompts.append(ids)
        rows = []
        for b in a.batches:
            fn = engine_generate_fn(model, eos_token_ids(model, tok), batch_size=b, graphs=cuda)
            fn(sorted(prompts, key=len)[:b], a.max_new)  # warm-up: graphs captured, kernels chosen
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            outs = fn(prompts, a.max_new)
            if cuda:
                torch.cuda.synchronize()
            s = time.perf_counter() - t
            new = sum(len(o) for o in outs)
            rows.append({"batch": b, "exchanges": len(prompts), "seconds": round(s, 2),
                         "exchanges_per_s": round(len(prompts) / s, 1), "new_tokens_per_s": round(new / s),
                         "mean_new_tokens": round(new / len(prompts), 1)})
            print(f"batch {b}: {len(prompts)} exchanges in {s:.1f} s, {len(prompts) / s:.1f}/s, "
                  f"{new / s:,.0f} new tokens/s", flush=True)
        result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "max_new": a.max_new, "rows": rows}
        if a.out:
            atomic_write_json(a.out, result)
        print(json.dumps(result))
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
