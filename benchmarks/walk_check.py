"""How well the trainer's acceptance estimates predict the engine's, on the same texts.

    python benchmarks/walk_check.py --head DIR --data DIR [--examples 10] [--k 3] [--device cpu] [--out F]

For each of the first examples of the data's eval split: the prompt (the tokens before its first
assistant turn) is continued greedily by the target through our engine (plain decoding), then the
head drafts chains of k on that prompt through the engine (``tau``, and the acceptance rate of the
first draft); on the text prompt + that continuation the trainer's estimates are computed:
``sim`` (``simulated_accept_len``: 1 + sum of products of per-step accuracies averaged over all
positions) and ``walked`` (``walked_accept_len``: the spans decoded round by round from the
per-position agreements). In float32 the engine's first drafts are the trainer's step-0
predictions, so ``walked`` should equal the engine's tau up to the draft vocabulary (the trainer
scores agreement with the target's argmax over the draft vocabulary only). Also the step-0
accuracy over every position (what ``sim`` multiplies) against its value at the positions where
rounds start, and the share of the continuation's 4-grams seen earlier in the text (repetition,
which long greedy continuations of a small model fall into and which drafts predict easily).
Prints a table and a final JSON line; ``--out`` also writes the JSON.
"""

from __future__ import annotations

import argparse
import json

import torch

from outrider.bench import repeated_ngrams
from outrider.engine import SpecEngine, eos_token_ids
from outrider.fsutil import atomic_write_json
from outrider.models import load_model
from outrider.proposers.eagle3 import Eagle3Proposer
from outrider.train.capture import capture
from outrider.train.data import load_dataset
from outrider.train.ttt import simulated_accept_len, ttt_loss, walked_accept_len


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--examples", type=int, default=10)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtype = "float32" if a.device == "cpu" else "bfloat16"
    model, tok = load_model("default", device=a.device, dtype=dtype)
    eos = eos_token_ids(model, tok)
    proposer = Eagle3Proposer.load(a.head, model)
    head = proposer.head
    head.bind_embedding(model.get_input_embeddings())
    draft_ids = torch.arange(head.config.draft_vocab_size, device=model.device) + head.d2t
    ar, spec = SpecEngine(model, None, eos_ids=eos), SpecEngine(model, proposer, k=a.k, eos_ids=eos)
    ds = load_dataset(a.data, "eval")
    rows, tot = [], {"engine": [0, 0], "walked": [0, 0], "first": [0, 0], "step0": [0, 0], "walk_first": [0, 0],
                     "repeat": [0, 0]}
    sim_sum = 0.0
    print("| example | new tokens | engine tau | walked tau | sim tau | engine first-draft rate | repeated 4-grams |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i in range(min(a.examples, len(ds))):
        ids, mask = ds[i]
        start = int(mask.nonzero()[0])
        prompt = ids[:start].long().tolist()
        text = ar.generate([prompt], a.max_new).tokens[0]
        r = spec.generate([prompt], a.max_new)
        assert r.tokens[0] == text, "speculative output differs from greedy output"
        seq = torch.tensor([prompt + text], device=model.device)
        loss_mask = torch.zeros_like(seq)
        loss_mask[0, start:] = 1
        cap = capture(model, seq, None, head.config.aux_layer_ids, draft_ids)
        with torch.no_grad():
            out = ttt_loss(head, head.embed, cap.aux.to(head.fc.weight.dtype), seq, loss_mask, cap.teacher,
                           steps=a.k, reduction="sum", agree_map=True)
        w_tok, w_rounds, w_first = walked_accept_len(out.agree, loss_mask, k=a.k)
        sim = float(simulated_accept_len(out.per_step_acc))
        tot["engine"][0] += sum(r.accepted) + r.row_steps
        tot["engine"][1] += r.row_steps
        tot["walked"][0] += w_tok
        tot["walked"][1] += w_rounds
        tot["first"][0] += r.accepted[0]
        tot["first"][1] += r.proposed[0]
        tot["step0"][0] += int(out.per_step_correct[0])
        tot["step0"][1] += int(out.per_step_tokens[0])
        tot["walk_first"][0] += w_first
        tot["walk_first"][1] += w_rounds
        sim_sum += sim
        rep, grams = repeated_ngrams(prompt, text)
        tot["repeat"][0] += rep
        tot["repeat"][1] += grams
        row = {"example": i, "new_tokens": len(text), "engine_tau": r.tau, "walked_tau": w_tok / w_rounds,
               "sim_tau": sim, "engine_first_rate": r.accepted[0] / max(r.proposed[0], 1),
               "repeated_4grams": rep / max(grams, 1)}
        rows.append(row)
        print(f"| {i} | {len(text)} | {r.tau:.3f} | {w_tok / w_rounds:.3f} | {sim:.3f} | "
              f"{row['engine_first_rate']:.3f} | {row['repeated_4grams']:.2f} |", flush=True)
    summary = {"k": a.k, "examples": len(rows), "device": a.device, "dtype": dtype,
               "engine_tau": tot["engine"][0] / tot["engine"][1], "walked_tau": tot["walked"][0] / tot["walked"][1],
               "sim_tau_mean": sim_sum / max(len(rows), 1), "engine_first_rate": tot["first"][0] / tot["first"][1],
               "step0_acc_all_positions": tot["step0"][0] / tot["step0"][1],
               "step0_acc_at_round_starts": tot["walk_first"][0] / tot["walk_first"][1],
               "repeated_4grams": tot["repeat"][0] / max(tot["repeat"][1], 1), "rows": rows}
    print(f"| all | | {summary['engine_tau']:.3f} | {summary['walked_tau']:.3f} | {summary['sim_tau_mean']:.3f} | "
          f"{summary['engine_first_rate']:.3f} | {summary['repeated_4grams']:.2f} |")
    print(f"step-0 accuracy over every position {summary['step0_acc_all_positions']:.3f}, at the positions where "
          f"rounds start {summary['step0_acc_at_round_starts']:.3f}")
    if a.out:
        atomic_write_json(a.out, summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))


if __name__ == "__main__":
    main()
