"""How well the trainer's acceptance estimates predict the engine's, on the same texts.

    python benchmarks/walk_check.py --head DIR (--data DIR [--texts all|seen|unseen|first|later] | --prompts SRC)
        [--examples 10] [--k 3[,5,...]] [--no-engine] [--read-len auto|max] [--max-new 128] [--device cpu] [--out F]

Texts: the prompts of the first examples of a token dataset's eval split (``--data``: the tokens
before an example's first assistant turn; ``--texts seen``: only the examples whose opening a train
example of the same dataset has, the ones a split that ignores openings leaves in eval, ``unseen``:
the others; ``first``: the examples that are a conversation's first exchange, whose id
``sharegpt.training_exchanges`` leaves without a ``#``, as the bench's held-out prompts are, ``later``:
the later user turns and exchanges), or held-out prompts (``--prompts``: 'sharegpt', a .txt or
a .json list, as ``outrider bench`` takes them), each continued greedily by the target through our
engine (plain decoding). On each text prompt + continuation the trainer's estimates are computed from
one TTT unroll of max(k) steps: ``walked`` (``walked_accept_len``: the spans decoded round by round
from the per-position agreements, the trainer's eval figure) and ``sim`` (``simulated_accept_len``:
1 + sum of products of per-step accuracies averaged over all positions), for every k of ``--k``.
Unless ``--no-engine``, the head also drafts chains of each k on the prompt through the engine
(``tau``, and the acceptance rate of the first draft; ``--read-len max``: over the static slot cache,
so that greedy chains run as device rounds, the GPU's path, on the CPU too). In float32 every draft of the engine's chain
is the unroll's prediction (``tests/test_eagle3_proposer.py``; in bf16 a near-tie may let the speculative text
part from the plain one: counted, ``texts_parted``, and judged as ``bench`` judges its runs: a
difference that is not a near-tie is a mismatch, exit status 1), so ``walked`` equals the engine's tau
up to each text's last round (the walk stops at the text's end) and to the draft vocabulary (the
trainer scores agreement with the target's argmax over the draft vocabulary only); ``--no-engine``
then gives the engine's figure for several k at the cost of one greedy pass per prompt. Also the
step-0 accuracy over every position (what ``sim`` multiplies) against its value at the positions
where rounds start, and the share of the continuation's 4-grams seen earlier in the text
(repetition, which long greedy continuations of a small model fall into and which drafts predict
easily). Prints a table per k and a final JSON line; ``--out`` also writes the JSON (``by_k``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from outrider.bench.local import load_prompts, repeated_ngrams
from outrider.bench.verdict import judge
from outrider.interop.drafts import load_head_for
from outrider.decode.engine import SpecEngine, eos_token_ids
from outrider.decode.proposers.eagle3 import Eagle3Proposer
from outrider.errors import UserError
from outrider.fsutil import atomic_write_json
from outrider.models import load_model
from outrider.train.states.capture import capture
from outrider.train.data.datasets import load_dataset, opening
from outrider.train.loop.ttt import simulated_accept_len, ttt_loss, walked_accept_len


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--k takes integers separated by commas, got {text!r}") from None
    if not ks or ks[0] < 1:
        raise UserError(f"--k needs chain lengths >= 1, got {text!r}")
    return ks


def prompts_of(a: argparse.Namespace, tok) -> list[tuple[list[int], str]]:
    """(prompt ids, label) of the texts to continue."""
    if a.prompts:
        return [(p, f"prompt {i}") for i, p in enumerate(load_prompts(tok, a.prompts, a.examples))]
    ds = load_dataset(a.data, "eval")
    seen: set[bytes] = set()
    if a.texts in ("seen", "unseen"):
        train = load_dataset(a.data, "train")
        seen = {opening(ids, m) for ids, m in zip(train.input_ids, train.loss_mask)}
    out = []
    for i in range(len(ds)):
        if len(out) >= a.examples:
            break
        if a.texts in ("seen", "unseen") and (opening(ds.input_ids[i], ds.loss_mask[i]) in seen) != (a.texts == "seen"):
            continue
        if a.texts in ("first", "later") and ("#" in ds.conv_ids[i]) != (a.texts == "later"):
            continue
        ids, mask = ds[i]
        out.append((ids[:int(mask.nonzero()[0])].long().tolist(), f"example {i}"))
    if not out:
        raise UserError(f"no {a.texts} eval example in {a.data}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a token dataset folder: the prompts of its eval split")
    src.add_argument("--prompts", help="held-out prompts: 'sharegpt', a .txt (one per line) or a .json list")
    ap.add_argument("--texts", default="all", choices=("all", "seen", "unseen", "first", "later"),
                    help="with --data: the eval examples whose opening a train example has (seen), the others "
                         "(unseen), conversations' first exchanges (first), the later turns (later), or all")
    ap.add_argument("--examples", type=int, default=10)
    ap.add_argument("--k", default="3", help="chain lengths, e.g. 5 or 3,4,5,6,7")
    ap.add_argument("--no-engine", action="store_true", help="the trainer's estimates only, no speculative pass")
    ap.add_argument("--read-len", default="auto", choices=("auto", "used", "max"),
                    help="the speculative engines' cache reads (max: static, device rounds on any device)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.texts != "all" and not a.data:
        ap.error("--texts picks eval examples of --data")
    try:
        return run(a)
    except UserError as e:
        print(f"walk_check: {e}", file=sys.stderr)
        return 2


def run(a: argparse.Namespace) -> int:
    ks = parse_ks(a.k)
    dtype = "float32" if a.device == "cpu" else "bfloat16"
    model, tok = load_model("default", device=a.device, dtype=dtype)
    eos = eos_token_ids(model, tok)
    proposer = Eagle3Proposer(load_head_for(a.head, model), model)
    head = proposer.head
    head.bind_embedding(model.get_input_embeddings())
    draft_ids = torch.arange(head.config.draft_vocab_size, device=model.device) + head.d2t
    ar = SpecEngine(model, None, eos_ids=eos)
    specs = {} if a.no_engine else {k: SpecEngine(model, proposer, k=k, eos_ids=eos, read_len=a.read_len) for k in ks}
    totals = {k: {"engine": [0, 0], "walked": [0, 0], "first": [0, 0], "walk_first": 0, "sim": 0.0} for k in ks}
    step0, repeat, rows = [0, 0], [0, 0], []
    differ = dict.fromkeys(ks, 0)  # texts whose speculative output left the plain one
    prompts, plain, spec_out = [], [], {k: [] for k in ks}
    for prompt, label in prompts_of(a, tok):
        text = ar.generate([prompt], a.max_new).tokens[0]
        prompts.append(prompt)
        plain.append(text)
        seq = torch.tensor([prompt + text], device=model.device)  # [1, P + T]
        loss_mask = torch.zeros_like(seq)
        loss_mask[0, len(prompt):] = 1  # the continuation is the text the chains walk
        cap = capture(model, seq, None, head.config.aux_layer_ids, draft_ids)
        with torch.no_grad():
            out = ttt_loss(head, head.embed, cap.aux.to(head.fc.weight.dtype), seq, loss_mask, cap.teacher,
                           steps=max(ks), reduction="sum", agree_map=True)
        step0[0] += int(out.per_step_correct[0])
        step0[1] += int(out.per_step_tokens[0])
        rep, grams = repeated_ngrams(prompt, text)
        repeat[0] += rep
        repeat[1] += grams
        row = {"text": label, "new_tokens": len(text), "repeated_4grams": rep / max(grams, 1), "by_k": {}}
        for k in ks:
            t = totals[k]
            w_tok, w_rounds, w_first = walked_accept_len(out.agree, loss_mask, k=k)
            sim = float(simulated_accept_len(out.per_step_acc[:k]))
            t["walked"][0] += w_tok
            t["walked"][1] += w_rounds
            t["walk_first"] += w_first
            t["sim"] += sim
            got = {"walked_tau": w_tok / max(w_rounds, 1), "sim_tau": sim}
            if specs:
                r = specs[k].generate([prompt], a.max_new)
                spec_out[k].append(r.tokens[0])
                differ[k] += int(r.tokens[0] != text)  # judged below: a near-tie, or a mismatch
                t["engine"][0] += sum(r.accepted) + r.row_steps
                t["engine"][1] += r.row_steps
                t["first"][0] += r.accepted[0]
                t["first"][1] += r.proposed[0]
                got.update(engine_tau=r.tau, engine_first_rate=r.accepted[0] / max(r.proposed[0], 1))
            row["by_k"][str(k)] = got
        rows.append(row)
        print(f"{label}: {len(text)} new tokens, repeated 4-grams {row['repeated_4grams']:.2f}; "
              + "; ".join(f"k={k} " + ", ".join(f"{n} {v:.3f}" for n, v in g.items()) for k, g in row["by_k"].items()),
              flush=True)
    n = max(len(rows), 1)
    by_k = {}
    for k in ks:
        t = totals[k]
        s = {"walked_tau": t["walked"][0] / max(t["walked"][1], 1), "walked_tokens": t["walked"][0],
             "walked_rounds": t["walked"][1], "sim_tau_mean": t["sim"] / n,
             "step0_acc_at_round_starts": t["walk_first"] / max(t["walked"][1], 1)}
        if specs:
            s.update(engine_tau=t["engine"][0] / max(t["engine"][1], 1),
                     engine_first_rate=t["first"][0] / max(t["first"][1], 1), texts_parted=differ[k])
        by_k[str(k)] = s
    summary = {"ks": ks, "examples": len(rows), "source": a.prompts or a.data, "device": a.device, "dtype": dtype,
               "read_len": a.read_len,
               "max_new": a.max_new, "step0_acc_all_positions": step0[0] / max(step0[1], 1),
               "repeated_4grams": repeat[0] / max(repeat[1], 1), "by_k": by_k, "rows": rows}
    print("| k | engine tau | walked tau (tokens / rounds) | sim tau | engine first-draft rate | step 0 at round starts |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k, s in by_k.items():
        engine = f"{s['engine_tau']:.3f}" if specs else "-"
        first = f"{s['engine_first_rate']:.3f}" if specs else "-"
        print(f"| {k} | {engine} | {s['walked_tau']:.3f} ({s['walked_tokens']} / {s['walked_rounds']}) | "
              f"{s['sim_tau_mean']:.3f} | {first} | {s['step0_acc_at_round_starts']:.3f} |")
    print(f"step-0 accuracy over every position {summary['step0_acc_all_positions']:.3f}; "
          f"repeated 4-grams {summary['repeated_4grams']:.2f}")
    verdicts = {k: judge(model, prompts, plain, [spec_out[k]], k) for k in ks if differ[k]}
    for k, v in verdicts.items():
        by_k[str(k)]["verdict"] = v.text()
        print(f"k={k}: {differ[k]} texts parted from the plain greedy ones (their engine tau is over the speculative "
              f"text): {v.text()}")
    if a.out:
        atomic_write_json(a.out, summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    return 0 if all(v.lossless for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
