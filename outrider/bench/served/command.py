"""``outrider bench --server`` / ``--compare`` as one call: measure, compare with here, print, write.

Contract: ``bench_served(...)`` draws the prompts (``bench.local.prompt_texts``: held-out
ShareGPT or a prompt file), runs ``served.measure.served_bench`` (records written after every
level), and, given the ``target``, decodes the same prompts here (``served.offline``): the served
greedy outputs against ours (``outputs_equal_local`` on each record), and with ``draft`` the
head's walked tau against the served one (``served_vs_offline`` with inspect's findings). The
records are rewritten with those fields, then the table and verdicts are printed.
``compare_files(a, b)`` reads two earlier runs and prints the first's speedup over the second.

Not done here: the measuring itself (``served.measure``), parsing flags (``outrider.cli``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from outrider.errors import UserError
from outrider.records import read_records, write_records
from outrider.bench.served import measure as served
from outrider.bench.served import offline


def _offline_fields(records: list[dict[str, Any]], target: str, draft: str | None, texts: Sequence[str],
                    max_new_tokens: int, k: int, device: str | None, dtype: str | None, console,
                    method: str) -> None:
    spec_k = next((r["k"] for r in records if r.get("tau") is not None and r.get("k")), k)
    local = offline.local_run(target, texts, max_new_tokens, draft=draft, k=spec_k, device=device, dtype=dtype,
                              method=method if method in ("parallel", "dflash") else "eagle3")
    checks = []
    if draft is not None:
        from outrider.interop import inspect as compat

        checks = compat.inspect(target, draft).checks
    for r in records:
        if r.get("temperature", 0.0) == 0.0:
            cmp = offline.compare_outputs(r["outputs"], local.outputs)
            r["outputs_equal_local"] = cmp["equal"]
            r["output_differences"] = [row for row in cmp["rows"] if not row["equal"]][:5]
            console.print(f"{r['role']} c={r['concurrency']}: greedy outputs equal to ours on {cmp['equal']} of "
                          f"{cmp['compared']} prompts", highlight=False)
        if draft is not None and r["role"] == "server":
            verdict = offline.gap(r.get("tau"), local.uncut_tau, checks, r.get("engine"))
            r["offline_tau"], r["offline_accept_rate_per_pos"] = local.tau, local.accept_rate_per_pos
            r["offline_uncut_tau"] = local.uncut_tau
            r["served_vs_offline"] = verdict
            console.print(f"{r['role']} c={r['concurrency']}: {'FLAGGED: ' if verdict['flagged'] else ''}"
                          f"{verdict['verdict']}", highlight=False)


def bench_served(server: str, concurrency: Sequence[int], prompts: str = "sharegpt", num_prompts: int = 10,
                 max_new_tokens: int = 128, model: str | None = None, baseline: str | None = None,
                 baseline_model: str | None = None, temperature: float = 0.0, seed: int | None = None,
                 timeout: float = 60.0, method: str = "eagle3", target: str | None = None, draft: str | None = None,
                 k: int = 3, device: str | None = None, dtype: str | None = None, json_path: str | None = None,
                 console=None, log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    from outrider.bench.local import prompt_texts

    texts = prompt_texts(prompts, num_prompts)
    if len(texts) < num_prompts:  # nothing shortened in silence: the records hold how many ran
        notice = f"notice: --num-prompts {num_prompts}, but {prompts} holds {len(texts)}: ran {len(texts)}"
        if console is not None:
            console.print(notice, highlight=False)
        elif log is not None:
            log(notice)
    records, failure = served.served_bench(server, texts, concurrency, max_new_tokens, model, baseline,
                                           baseline_model, temperature, seed, timeout, method, json_path, log)
    if target is not None and failure is None:
        _offline_fields(records, target, draft, texts, max_new_tokens, k, device, dtype, console, method)
    if console is not None and records:
        served.print_table(records, console)
    if json_path and records:
        write_records(json_path, records)
    if failure is not None:
        kept = f"; the levels measured so far are in {json_path}" if json_path and json_path != "-" else ""
        raise UserError(failure + kept)
    return records


def compare_files(a: str, b: str, console=None, json_path: str | None = None) -> list[dict[str, Any]]:
    records = served.compare(read_records(a, "served records"), read_records(b, "served records"))
    if console is not None:
        served.print_table(records, console)
    if json_path:
        write_records(json_path, records)
    return records
