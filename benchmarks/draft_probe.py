"""Where an EAGLE-3 draft chain's time goes on the GPU; no weights needed.

    python benchmarks/draft_probe.py --out $OUT [--k 5] [--modes eager,compiled]

A randomly initialised model of the default model's shape and a random head (``step_probe``;
``--head HEAD``: the default model and a trained head).
For each mode (CUDA graphs of eager kernels; of the ``torch.compile``-fused draft step), the
engine runs greedy EAGLE-3 device rounds once to capture its two graphs; then the draft graph
(the pending step over k+1 verified positions, k-1 chain steps, k greedy draws) is replayed
alone, the head cache's lengths restored after each replay, and timed with CUDA events. A
profiler table of the draft graph's kernels (20 replays) is written per mode to
``$OUT/draft-kernels-<mode>.txt``; the timings to ``$OUT/draft-probe.json``. With ``--verify``
also the round's verification graph (the target's step over k+1 tokens, the acceptance, the
commit): replayed alone, then followed by the draft graph as the engine replays them, with the
round's state restored after each (the draft's time after a verification against alone tells a
GPU-side cost of the alternation from host-side gaps), and its kernel table
(``$OUT/verify-kernels-<mode>.txt``). The target's step by width alone: ``step_probe.py``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from step_probe import _timed, probe_models

from outrider.decode.engine import SpecEngine
from outrider.decode.proposers.eagle3 import Eagle3Proposer
from outrider.fsutil import atomic_write_json

REPLAYS = 200


def _kernel_table(fn, n: int, rows: int = 40) -> tuple[str, float]:
    """Profiler table of ``n`` calls of ``fn`` and its CUDA kernels per call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return events.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=90), kernels / n


def verify_tables(rounds, mode: str, k: int, out_dir: Path) -> dict:
    """The verification graph alone and followed by the draft graph, the state restored after each."""
    verify, draft = rounds._graphs
    state = rounds._state()
    saved = [t.clone() for t in state]

    def restore():
        for dst, src in zip(state, saved):
            dst.copy_(src)

    def alone():
        verify.replay()
        restore()

    def paired():
        verify.replay()
        draft.replay()
        restore()

    restore_ms = _timed(restore, REPLAYS)
    res = {"verify_round_ms": _timed(alone, REPLAYS) - restore_ms}
    res["draft_after_verify_ms"] = _timed(paired, REPLAYS) - restore_ms - res["verify_round_ms"]
    table, kernels = _kernel_table(alone, 8)
    res["verify_round_kernels"] = kernels - len(state)
    (out_dir / f"verify-kernels-{mode}.txt").write_text(f"== the round's verification graph (k = {k}), "
                                                        f"{len(state)} restoring copies per replay\n{table}")
    print(f"  {mode} verification: " + ", ".join(f"{a} {b:.3f}" for a, b in res.items()), flush=True)
    return res


def probe(model, head, mode: str, k: int, prompt: list[int], out_dir: Path, with_verify: bool) -> dict:
    prop = Eagle3Proposer(head, model)
    eng = SpecEngine(model, prop, k=k, graphs=True, compile=mode == "compiled", rounds=8)
    t = time.perf_counter()
    eng.generate([prompt], 4 * (k + 1) * 9)  # capture (and compile) both graphs of a round
    build_s = time.perf_counter() - t
    verify, draft = eng._rounds_pool[(1, k)]._graphs  # kept with the engine once captured
    lengths = prop.cache.lengths
    saved = lengths.clone()

    def once():
        draft.replay()
        lengths.copy_(saved)

    restore_ms = _timed(lambda: lengths.copy_(saved), REPLAYS)
    draft_ms = _timed(once, REPLAYS) - restore_ms
    verify_ms = _timed(verify.replay, 1)  # one replay: the target cache advances with each
    table, kernels = _kernel_table(once, 20)
    (out_dir / f"draft-kernels-{mode}.txt").write_text(table)
    res = {"draft_ms": draft_ms, "per_draft_token_ms": draft_ms / k, "verify_ms_one_replay": verify_ms,
           "kernels_per_replay": kernels - 1, "build_s": round(build_s, 1),
           "head_cache_len": prop.cache.max_len}
    print(f"  {mode}: " + ", ".join(f"{a} {b:.3f}" if isinstance(b, float) else f"{a} {b}" for a, b in res.items()),
          flush=True)
    print(table[:6000], flush=True)
    if with_verify:
        res.update(verify_tables(eng._rounds_pool[(1, k)], mode, k, out_dir))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--verify", action="store_true", help="also profile the verification's side")
    ap.add_argument("--head", default=None, help="a trained head: the default model itself and this head "
                    "instead of random weights")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, head = probe_models(args.head)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist()
    results = {"device": torch.cuda.get_device_name(), "k": args.k}
    for mode in args.modes.split(","):
        results[mode] = probe(model, head, mode, args.k, prompt, out_dir, args.verify)
        atomic_write_json(out_dir / "draft-probe.json", results)


if __name__ == "__main__":
    main()
