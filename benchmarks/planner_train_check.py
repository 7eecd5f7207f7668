"""The training plan's stage times against runs that happened: regeneration, training, evaluation.

    python benchmarks/planner_train_check.py [--data D.json ...] [--train T.json ...] [--bench B.json ...]
        [--hardware h200] [--example-tokens N] [--out check.json]

``--data``: records of ``gpu_session.py data`` (``{"data": {seconds, regenerated, kept, tokens, loss_tokens,
...}}``): the plan's regeneration time for the replies regenerated, at the kept examples' mean reply
length, against ``seconds``.
``--train``: records of ``gpu_session.py train-bench`` (``{"train": {train_tokens, train_s, ...}}``):
the plan's training time (online capture: the target's forward counted) for ``train_tokens``
against ``train_s``. ``--bench``: ``bench`` records (a list, or ``{"records": [...]}``) with
``stage_s`` where the session recorded it: the plan's evaluation time for the same prompts, tokens
and pass pairs against the stage's seconds. The rates are ``outrider.plan.rates``' (some measured
on some of these very runs: the table says which). Prints one row per record and stage.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from outrider.fsutil import atomic_write_json
from outrider.plan.train_plan import train_plan


def _load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def _plan(hardware: str, example_tokens: int, **kw):
    return train_plan("default", hardware, gpus=1, conversations=kw.pop("conversations", 1000), turns=1,
                      tokens_per_turn=example_tokens, max_length=max(example_tokens, 1), **kw)


def check_data(path: str, hardware: str) -> dict:
    d = _load(path)["data"]
    kept, tokens, loss, regen = d["kept"], d["tokens"], d["loss_tokens"], d["regenerated"]
    share = loss / tokens  # replies regenerated at the kept examples' mean length
    p = _plan(hardware, round(tokens / kept), conversations=regen, rates={"reply_share": share},
              regenerate="local", capture="online")
    stage = p.stages[0]
    return {"record": Path(path).name, "stage": "regeneration", "measured_s": d["seconds"],
            "predicted_s": stage.time.value,
            "detail": f"{regen:,} replies regenerated ({kept:,} kept, {loss / kept:.0f} assistant tokens each)"}


def check_train(path: str, hardware: str, example_tokens: int) -> dict:
    t = _load(path)["train"]
    n = t["train_tokens"]
    conv = max(1, round(n / example_tokens))
    p = _plan(hardware, example_tokens, conversations=conv, epochs=n / (conv * example_tokens),
              regenerate="none", capture="online")
    stage = p.stages[3]
    return {"record": Path(path).name, "stage": "training", "measured_s": t["train_s"],
            "predicted_s": stage.time.value, "detail": f"{n / 1e6:.1f} M tokens, preset {t.get('preset')}"}


def check_bench(path: str, hardware: str) -> list[dict]:
    data = _load(path)
    stages = data.get("stage_s", {}) if isinstance(data, dict) else {}
    records = data["records"] if isinstance(data, dict) else data
    rows = []
    for r in records:
        key = next((s for s in stages if s.endswith(f"_{r['method']}_b{r.get('batch_size', 1)}_k{r['k']}")), None)
        if key is None:
            continue
        p = _plan(hardware, 400, regenerate="none", capture="online", k=r["k"], eval_prompts=r["num_prompts"],
                  eval_new_tokens=r["max_new_tokens"], eval_repeats=r.get("repeats", 1))
        rows.append({"record": Path(path).name, "stage": "evaluation", "measured_s": stages[key],
                     "predicted_s": p.stages[4].time.value,
                     "detail": f"{r['num_prompts']} prompts x {r['max_new_tokens']}, {r.get('repeats', 1)} pass pairs"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs="*", default=[])
    ap.add_argument("--train", nargs="*", default=[])
    ap.add_argument("--bench", nargs="*", default=[])
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--example-tokens", type=int, default=400, help="mean tokens per training example")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [check_data(p, a.hardware) for p in a.data] + [check_train(p, a.hardware, a.example_tokens)
                                                           for p in a.train]
    for p in a.bench:
        rows += check_bench(p, a.hardware)
    print("| stage | record | measured | predicted | error | what |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        r["error"] = r["predicted_s"] / r["measured_s"] - 1
        print(f"| {r['stage']} | {r['record']} | {r['measured_s']:.0f} s | {r['predicted_s']:.0f} s | "
              f"{100 * r['error']:+.0f} % | {r['detail']} |")
    if rows:
        print(f"worst |error| {100 * max(abs(r['error']) for r in rows):.0f} % over {len(rows)} stage(s)")
    if a.out:
        atomic_write_json(a.out, rows)


if __name__ == "__main__":
    main()
