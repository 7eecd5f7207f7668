"""A head's acceptance on held-out text as training scores it: the target's greedy replies to the
prompts, then the TTT unroll over them (``outrider.train.ttt``) and the walk of its chains.

Contract: ``python benchmarks/heldout_walk.py --head HEAD [--prompts F] [--num-prompts N]
[--ks 4,5,6] [--max-new-tokens T] [--json OUT]`` prints, per prompt, the walked tau at each k (bonus
token included) and the teacher-forced agreement of each unrolled step, then the walked tau over all
prompts; ``--json`` writes them. Float32 on the CPU by default: the text is the plain greedy one,
which the engine's lossless greedy speculation emits, so the walked tau is the tau ``outrider bench
--method eagle3`` measures on it, up to the last round of each reply (the walk stops at the reply's
end, the engine counts the round that crosses it). ``tests/test_eagle3_proposer.py`` checks that
every draft of the engine's chain is the unroll's. Cheaper than the bench (one greedy pass and one
scoring forward per prompt, no speculative pass), and it shows which unrolled steps disagree with
the target.
"""

from __future__ import annotations

import argparse
import sys

import torch

from outrider.bench import load_prompts
from outrider.export import load_head
from outrider.errors import UserError
from outrider.fsutil import atomic_write_json
from outrider.models import load_model
from outrider.train.capture import TargetCapture
from outrider.train.ttt import ttt_loss, walked_accept_len


def walk_prompt(model, head, capture: TargetCapture, prompt: list[int], ks: list[int],
                max_new_tokens: int) -> dict:
    ids = torch.tensor([prompt])  # [1, P]
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)  # [1, P + T]
        loss_mask = torch.zeros_like(seq)
        loss_mask[:, len(prompt):] = 1  # the reply is the text the chains walk
        captured = capture(seq, torch.ones_like(seq))
        out = ttt_loss(head, head.embed, captured.aux, seq, loss_mask, captured.teacher, steps=max(ks),
                       agree_map=True)
    walks = {k: walked_accept_len(out.agree, loss_mask, k=k) for k in ks}
    return {"prompt_tokens": len(prompt), "reply_tokens": seq.shape[1] - len(prompt),
            "walks": {str(k): {"tokens": w.tokens, "rounds": w.rounds} for k, w in walks.items()},
            "step_agreement": [round(float(a), 4) for a in out.per_step_acc]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True, help="an EAGLE-3 head folder (outrider or vLLM format)")
    p.add_argument("--target", default="default")
    p.add_argument("--prompts", default="sharegpt", help="'sharegpt' (held-out split), a .txt or a .json list")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--ks", default="5", help="drafts per round, one walk each: e.g. 4,5,6")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    try:
        return run(a)
    except UserError as e:
        print(f"heldout_walk: {e}", file=sys.stderr)
        return 2


def run(a: argparse.Namespace) -> int:
    try:
        ks = sorted({int(x) for x in a.ks.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--ks takes integers separated by commas, got {a.ks!r}") from None
    if not ks or ks[0] < 1:
        raise UserError(f"--ks needs drafts per round >= 1, got {a.ks!r}")
    model, tok = load_model(a.target, device="cpu", dtype=getattr(torch, a.dtype))
    head, _ = load_head(a.head, target_config=model.config)
    head = head.to(model.dtype).eval()
    head.bind_embedding(model.get_input_embeddings())
    draft_ids = torch.arange(head.config.draft_vocab_size) + head.d2t  # [draft_vocab] target ids
    capture = TargetCapture(model, head.config.aux_layer_ids, draft_ids)
    rows = []
    for i, prompt in enumerate(load_prompts(tok, a.prompts, a.num_prompts)):
        row = walk_prompt(model, head, capture, prompt, ks, a.max_new_tokens)
        rows.append(row)
        taus = ", ".join(f"@{k} {w['tokens'] / max(w['rounds'], 1):.3f}" for k, w in row["walks"].items())
        print(f"prompt {i}: {row['reply_tokens']} reply tokens, walked tau {taus}; step agreement "
              + " / ".join(f"{x:.2f}" for x in row["step_agreement"]), flush=True)
    walked = {}
    for k in ks:
        tokens = sum(r["walks"][str(k)]["tokens"] for r in rows)
        rounds = sum(r["walks"][str(k)]["rounds"] for r in rows)
        walked[str(k)] = {"tokens": tokens, "rounds": rounds, "tau": tokens / max(rounds, 1)}
        print(f"walked tau@{k} over {len(rows)} prompts: {walked[str(k)]['tau']:.4f} "
              f"({tokens} tokens, {rounds} rounds)")
    result = {"head": a.head, "target": a.target, "num_prompts": len(rows), "dtype": a.dtype,
              "max_new_tokens": a.max_new_tokens, "walked": walked, "prompts": rows}
    if a.json:
        atomic_write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
