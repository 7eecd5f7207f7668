"""Benchmarks: acceptance and speed of one method against the autoregressive baseline, same run.

Contract: ``bench(...)`` loads the target once, draws prompts (by default first user turns of
the held-out ShareGPT split, rendered with the target's chat template), warms up, then decodes
the same prompts with plain autoregressive decoding (our engine, and optionally Hugging Face
``generate``) and with the chosen method. It returns one record (``outrider.records``, its JSON
form) and, after printing the table, writes a JSON list of records atomically (when that file
cannot be written, to a temporary file that the one-line error names), with at least: method, k, num_prompts, new_tokens, tau,
accept_rate_per_pos, tokens_per_s, ar_tokens_per_s, speedup_vs_ar, lossless, device, dtype.
Greedy runs carry the lossless verdict (``verdict.py``): ``exact``, equal up to near-ties
whose margins are within the measured rounding of the dtype, or ``NO`` with the first mismatch;
``lossless`` is false only for ``NO``.
``tau`` is the tokens a verify step emits per row (at most k+1, and a step cut by EOS or
max_new_tokens counts what it emitted). Prompt files are plain text (one per line) or a JSON list
of strings; a conversation file is refused. Nothing is shortened in silence: a prompt longer than
``max_prompt_tokens`` (512 by default) keeps the chat template's start and end around the last
tokens of its text, and is counted (``truncated_prompts``, in the record and under the table);
a prompt that comes out the same tokens as an earlier one is skipped for the next (``repeated_prompts``);
fewer prompts than asked is a notice, and ``num_prompts`` is what ran. Throughput counts new tokens over wall time of whole ``generate`` calls (prefill included).
With ``hf_baseline`` our autoregressive run and ``transformers`` ``generate`` alternate batch by
batch, so that a machine whose speed drifts during the run cannot favour either.

Not done here: server-level load tests, latency percentiles under concurrency (``bench.served``).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from outrider import assets, sharegpt
from outrider.decode.engine import SpecEngine, eos_token_ids
from outrider.decode.proposers import PROPOSERS
from outrider.decode.sampling import SamplingParams
from outrider.decode.state import GenerationResult
from outrider.errors import UserError, require
from outrider.fsutil import os_error_line, read_text
from outrider.interop.drafts import build_proposer
from outrider.models import load_model
from outrider.progress import Bar
from outrider.provenance import git_commit, today
from outrider.records import new_record, write_records
from outrider.trees import TreeSpec, record_fields
from outrider.bench.verdict import judge

METHODS = tuple(PROPOSERS)
MAX_PROMPT_TOKENS = 512  # bench's --max-prompt-tokens default


def _render(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    return list(ids)


def fit_prompt(tokenizer, text: str, max_prompt_tokens: int) -> tuple[list[int], bool]:
    """(token ids of ``text`` as a user turn in the chat template, whether it was shortened). A prompt
    longer than ``max_prompt_tokens`` keeps the template's start and end (system turn, role markers,
    generation prompt) around the last tokens of its text that fit."""
    ids = _render(tokenizer, text)
    if len(ids) <= max_prompt_tokens:
        return ids, False
    body = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    keep = len(body) - (len(ids) - max_prompt_tokens)
    while keep > 0:
        cut = _render(tokenizer, tokenizer.decode(body[len(body) - keep:]))
        if len(cut) <= max_prompt_tokens:
            return cut, True
        keep -= max(1, len(cut) - max_prompt_tokens)  # re-tokenised text can come out longer: shorten again
    bare = _render(tokenizer, "")
    require(len(bare) <= max_prompt_tokens, f"--max-prompt-tokens {max_prompt_tokens} is shorter than the chat "
            f"template alone ({len(bare)} tokens): raise it")
    return bare, True


def render_prompt(tokenizer, text: str, max_prompt_tokens: int) -> list[int]:
    """``fit_prompt``'s token ids."""
    return fit_prompt(tokenizer, text, max_prompt_tokens)[0]


@dataclass
class Prompts:
    """Prompts ready to decode: ``ids`` (one list per prompt), how many were ``asked`` for, and how
    many were ``truncated`` to ``max_prompt_tokens``."""

    ids: list[list[int]]
    asked: int
    truncated: int
    max_prompt_tokens: int
    repeated: int = 0  # prompts skipped because they came out the same tokens as an earlier one

    def notices(self, source: str) -> list[str]:
        """What the user must be told: fewer prompts than asked, prompts shortened, prompts skipped."""
        out = []
        if len(self.ids) < self.asked:
            out.append(f"--num-prompts {self.asked}, but {source} holds {len(self.ids)} distinct: ran {len(self.ids)}")
        if self.truncated:
            out.append(f"{self.truncated} of {len(self.ids)} prompts were longer than --max-prompt-tokens "
                       f"{self.max_prompt_tokens}: kept the chat template's start and end and the last tokens of "
                       "their text")
        if self.repeated:
            out.append(f"{self.repeated} prompt(s) came out the same tokens as an earlier one (after the cut to "
                       f"--max-prompt-tokens {self.max_prompt_tokens}, or repeated in {source}): skipped, the next "
                       "ones taken")
        return out


def prepare_prompts(tokenizer, source: str = "sharegpt", num_prompts: int = 10,
                    max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> Prompts:
    """``num_prompts`` distinct prompts (``prompt_texts``) in the chat template, fitted (``fit_prompt``)
    and counted. Two texts that differ only in what the cut drops come out the same tokens: the
    later one is skipped and the next text taken, so that no prompt is benched twice."""
    require(max_prompt_tokens >= 1, f"--max-prompt-tokens must be >= 1, got {max_prompt_tokens}")
    ids: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    truncated = repeated = drawn = 0
    limit = 2 * num_prompts  # spares for skipped repeats, so that the source is read once as a rule
    while len(ids) < num_prompts:
        texts = prompt_texts(source, limit)
        for text in texts[drawn:]:
            fitted, cut = fit_prompt(tokenizer, text, max_prompt_tokens)
            if tuple(fitted) in seen:
                repeated += 1
                continue
            seen.add(tuple(fitted))
            ids.append(fitted)
            truncated += cut
            if len(ids) == num_prompts:
                break
        if len(texts) < limit:  # the source holds no more
            break
        drawn, limit = len(texts), limit + num_prompts - len(ids)
    return Prompts(ids, num_prompts, truncated, max_prompt_tokens, repeated)


def load_prompts(tokenizer, source: str = "sharegpt", num_prompts: int = 10,
                 max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> list[list[int]]:
    """Token ids of ``num_prompts`` prompts (``prepare_prompts``) in the chat template."""
    return prepare_prompts(tokenizer, source, num_prompts, max_prompt_tokens).ids


def prompt_texts(source: str = "sharegpt", num_prompts: int = 10) -> list[str]:
    """The first ``num_prompts`` prompts of held-out ShareGPT, a .txt (one per line) or a .json list."""
    require(num_prompts >= 1, f"--num-prompts must be >= 1, got {num_prompts}")
    if source == "sharegpt":
        texts = sharegpt.first_user_turns(sharegpt.load_sharegpt(assets.sharegpt_path(pulled=True)), heldout_only=True, limit=num_prompts)
    else:
        texts = _prompt_file(Path(source))[:num_prompts]
    require(len(texts) > 0, f"no prompts in {source}")
    return texts


def _not_prompts(path: Path, item: Any, where: str) -> UserError:
    if isinstance(item, dict) and ("conversations" in item or "messages" in item):
        return UserError(f"{path} is a conversation file ({where} is a ShareGPT/OpenAI record), not prompts: give "
                         "a .txt file (one prompt per line) or a JSON list of strings")
    return UserError(f"{path}: {where} is {type(item).__name__}, not a prompt string: give a .txt file (one prompt "
                     "per line) or a JSON list of strings")


def _prompt_file(path: Path) -> list[str]:
    """Prompt texts of a .txt file (one per line) or a JSON list of strings; conversation records,
    JSON objects and JSONL records are refused (their Python repr would be benchmarked)."""
    require(path.is_file(), f"prompt file not found: {path}" if not path.exists() else f"{path} is not a file")
    raw = read_text(path, "a .txt file, one prompt per line, or a JSON list of strings")
    if path.suffix == ".json" or raw.lstrip().startswith(("[", "{")):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            if path.suffix == ".json" or raw.lstrip().startswith("["):
                raise UserError(f"{path} is not a JSON list of prompt strings: {e}") from None
            data = None  # JSONL, or text that merely starts with a brace: the lines decide below
        if data is not None:
            if not isinstance(data, list):
                raise _not_prompts(path, data, "the file's JSON")
            for i, item in enumerate(data):
                if not isinstance(item, str):
                    raise _not_prompts(path, item, f"item {i}")
            return data
    lines = [line for line in raw.splitlines() if line.strip()]
    for i, line in enumerate(lines[:3]):
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            raise _not_prompts(path, record, f"line {i + 1}")
    return lines


def _run(engine: SpecEngine, prompts: list[list[int]], batch_size: int, max_new: int, bar: Bar | None = None,
         k: int | None = None) -> tuple[list[list[int]], float, list[GenerationResult]]:
    """Generate batch by batch; the seconds count generation only (the bar draws between batches)."""
    outs, results, seconds = [], [], 0.0
    for i in range(0, len(prompts), batch_size):
        t0 = time.perf_counter()
        r = engine.generate(prompts[i:i + batch_size], max_new, k=k)
        engine.sync()  # the batch's tokens are on the host already: this waits for nothing more
        seconds += time.perf_counter() - t0
        outs.extend(r.tokens)
        results.append(r)
        if bar is not None:
            bar.advance()
    return outs, seconds, results


def hf_generate(model, prompts: list[list[int]], batch_size: int, max_new: int, eos: Sequence[int],
                 pad_id: int) -> tuple[list[list[int]], float]:
    outs = []
    dev = next(model.parameters()).device
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        P = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), P), pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros(len(chunk), P, dtype=torch.long, device=dev)
        for b, p in enumerate(chunk):  # left padding, as generate expects
            ids[b, P - len(p):] = torch.tensor(p, device=dev)
            mask[b, P - len(p):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             eos_token_id=list(eos) or None, pad_token_id=pad_id)
        for b in range(len(chunk)):
            toks = out[b, P:].tolist()
            for j, t in enumerate(toks):
                if t in eos:
                    toks = toks[:j + 1]
                    break
            outs.append(toks)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return outs, time.perf_counter() - t0


def repeated_ngrams(prompt: Sequence[int], text: Sequence[int], n: int = 4) -> tuple[int, int]:
    """(repeated, total): the n-grams that end inside ``text``, and how many of them occurred
    earlier in prompt + text. Long greedy continuations of small models loop, and drafts
    predict loops easily: a speedup is read next to this share."""
    seq, seen, rep, total = list(prompt) + list(text), set(), 0, 0
    for j in range(n, len(seq) + 1):
        gram = tuple(seq[j - n:j])
        if j > len(prompt):
            total += 1
            rep += gram in seen
        seen.add(gram)
    return rep, total


def _merge(results: list[GenerationResult]) -> dict[str, Any]:
    pooled = GenerationResult.pooled(results)
    steps = max(pooled.steps, 1)
    return {
        "steps": pooled.steps,
        "tau": pooled.tau,
        "accept_rate_per_pos": pooled.accept_rate_per_pos,
        "verify_step_ms": 1e3 * pooled.verify_s / steps,
        "propose_step_ms": 1e3 * pooled.propose_s / steps,
        # per generate call (a batch): its first draft, from the prompts (included in propose_step_ms)
        "prompt_draft_ms": 1e3 * pooled.prompt_draft_s / len(results),
        # the whole decode step, and all of it that is not the target's verify span (drafting,
        # feeding the outcome back): what a speculative step costs beyond its target forward
        "step_ms": 1e3 * pooled.decode_s / steps,
        # tokens after the first (which the prefill yields) over the decode loop's time
        "decode_tokens_per_s": (pooled.new_tokens - len(pooled.tokens)) / max(pooled.decode_s, 1e-12),
        "draft_step_ms": 1e3 * (pooled.decode_s - pooled.verify_s) / steps,
        "prefill_ms": 1e3 * pooled.prefill_s / len(results),  # per generate call
    }


def bench(target: str, method: str, draft: str | None = None, k: int = 4,
          tree: TreeSpec | None = None, num_prompts: int = 10,
          max_new_tokens: int = 128, batch_size: int = 1, temperature: float = 0.0, seed: int = 0,
          prompts: str = "sharegpt", device: str | None = None, dtype: str | None = None,
          hf_baseline: bool = False, json_path: str | None = None, console=None,
          loaded: tuple | None = None, graphs: bool | None = None, compile: bool | str | None = None,
          engines: tuple[SpecEngine, SpecEngine] | None = None, repeats: int = 1,
          log: Callable[[str], None] | None = None, progress: bool = False,
          max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> dict[str, Any]:
    """Measure ``method`` against autoregressive decoding on the same prompts; return one record.

    ``engines`` = (autoregressive, speculative) engines built earlier on ``loaded``'s model (a
    benchmark sweeping k reuses their caches, CUDA graphs and compiled code; ``k`` is set on
    the speculative one). ``repeats`` > 1 measures that many (autoregressive, method) pairs of
    passes back to back; tokens/s and speedups are then medians over the pairs, step costs and
    acceptance are pooled, and ``lossless`` must hold in every pass. ``log`` receives a line as
    each phase ends (warm-ups, which compile and capture, and passes), with its seconds;
    ``progress`` shows a bar on stderr over the timed batches of all passes. ``graphs`` and
    ``compile`` (None: on for CUDA, off elsewhere) choose the engine's fast path: steps replayed as
    CUDA graphs, fused by ``torch.compile`` with static shapes first. ``tree`` (``outrider.trees``: an
    EAGLE-2 budget or a static tree; ``method`` eagle3) drafts trees instead of chains of ``k``.
    """
    require(k >= 1, f"--k must be >= 1, got {k}")
    require(batch_size >= 1, f"--batch-size must be >= 1, got {batch_size}")
    require(max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    require(repeats >= 1, f"--repeats must be >= 1, got {repeats}")
    require(method in METHODS, f"unknown method '{method}': use one of {', '.join(METHODS)}")
    model, tokenizer = loaded if loaded is not None else load_model(target, device=device, dtype=dtype)
    dev = next(model.parameters()).device
    torch_dtype = next(model.parameters()).dtype
    prepared = prepare_prompts(tokenizer, prompts, num_prompts, max_prompt_tokens)
    prompt_ids = prepared.ids
    for notice in prepared.notices(prompts):
        if console is not None:
            console.print(f"notice: {notice}")
        elif log is not None:
            log(f"notice: {notice}")
    sampling = SamplingParams(temperature=temperature, seed=seed)
    eos = eos_token_ids(model, tokenizer)
    graphs = dev.type == "cuda" if graphs is None else graphs
    compile = dev.type == "cuda" if compile is None else compile  # the fast path by default on CUDA
    if engines is not None:
        ar, spec = engines
        proposer = spec.proposer
        graphs = spec.graphs
    else:
        proposer = build_proposer(method, PROPOSERS[method], model, tokenizer, draft, device=dev, dtype=torch_dtype,
                                  tree=tree)
        ar = SpecEngine(model, None, sampling=sampling, eos_ids=eos, graphs=graphs, compile=compile)
        spec = (SpecEngine(model, proposer, k=k, sampling=sampling, eos_ids=eos, graphs=graphs, compile=compile)
                if proposer else ar)
    clock = time.perf_counter()

    def done(what: str) -> None:
        nonlocal clock
        if log is not None:
            log(f"{what}: {time.perf_counter() - clock:.1f} s")
        clock = time.perf_counter()

    for engine in {id(ar): ar, id(spec): spec}.values():  # warm-up: first calls pay one-off costs
        if engine.graphs or engine.compile:  # a batch of the longest requests sizes the pooled cache:
            engine.generate(sorted(prompt_ids, key=len)[-batch_size:], max_new_tokens, k=k)  # no capture or
            # compilation inside the timing; with graphs every batch's prompt width (its forward,
            # the first draft) is captured too
            if engine.graphs:
                _run(engine, prompt_ids, batch_size, min(2, max_new_tokens), k=k)
        else:
            engine.generate(prompt_ids[:1], min(8, max_new_tokens), k=k)
        done(f"warm-up of the {'autoregressive' if engine.proposer is None else method} engine")
    batches = -(-len(prompt_ids) // batch_size)
    with Bar(progress, f"bench {method} vs ar", batches * (2 * repeats + hf_baseline), manual=True) as bar:
        if hf_baseline:  # ours and transformers alternate batch by batch: drifts of the machine hit both alike
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
            hf_generate(model, prompt_ids[:1], 1, min(8, max_new_tokens), eos, pad)
            done("warm-up of transformers' generate")
            ar_out, ar_s, ar_res, hf_out, hf_s = [], 0.0, [], [], 0.0
            for i in range(0, len(prompt_ids), batch_size):
                out, s, res = _run(ar, prompt_ids[i:i + batch_size], batch_size, max_new_tokens, bar)
                ar_out, ar_s, ar_res = ar_out + out, ar_s + s, ar_res + res
                out, s = hf_generate(model, prompt_ids[i:i + batch_size], batch_size, max_new_tokens, eos, pad)
                hf_out, hf_s = hf_out + out, hf_s + s
                bar.advance()
        else:
            ar_out, ar_s, ar_res = _run(ar, prompt_ids, batch_size, max_new_tokens, bar)
        sp_out, sp_s, sp_res = _run(spec, prompt_ids, batch_size, max_new_tokens, bar, k=k)
        passes = [((ar_out, ar_s, ar_res), (sp_out, sp_s, sp_res))]
        done(f"pass 1 of {repeats}")
        for i in range(repeats - 1):  # more (AR, method) pairs: the speed figures are medians over pairs
            passes.append((_run(ar, prompt_ids, batch_size, max_new_tokens, bar),
                           _run(spec, prompt_ids, batch_size, max_new_tokens, bar, k=k)))
            done(f"pass {i + 2} of {repeats}")
    sp_tokens = sum(len(t) for t in sp_out)
    m = _merge([r for _, (_, _, res) in passes for r in res])
    ar_m = _merge([r for (_, _, res), _ in passes for r in res])
    agree = min(sum(a == b for a, b in zip(ar_out, out)) for _, (out, _, _) in passes)
    nodes, steps = proposer.round_shape(k) if proposer else (0, 0)
    verdict = (judge(model, prompt_ids, ar_out, [out for _, (out, _, _) in passes], nodes)
               if sampling.greedy else None)
    pair_speedups = [(sum(map(len, so)) / ss) / (sum(map(len, ao)) / as_) for (ao, as_, _), (so, ss, _) in passes]
    pair_decode = [_merge(sr)["decode_tokens_per_s"] / _merge(ar_r)["decode_tokens_per_s"]
                   for (_, _, ar_r), (_, _, sr) in passes]
    reps = [repeated_ngrams(p, t) for p, t in zip(prompt_ids, ar_out)]
    fields: dict[str, Any] = {
        "method": method,
        "k": steps,  # a chain's k; a tree's steps (its depth)
        **tree_fields(proposer.tree if proposer else None, m["tau"]),
        "target": str(target),
        "draft": draft,
        "num_prompts": len(prompt_ids),  # that ran
        "num_prompts_asked": prepared.asked,
        "truncated_prompts": prepared.truncated,
        "repeated_prompts": prepared.repeated,  # skipped: the same tokens as an earlier prompt
        "max_prompt_tokens": prepared.max_prompt_tokens,
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "new_tokens": sp_tokens,
        "tau": m["tau"],
        "accept_rate_per_pos": m["accept_rate_per_pos"],
        "tokens_per_s": statistics.median(sum(map(len, o)) / t for _, (o, t, _) in passes),
        "ar_tokens_per_s": statistics.median(sum(map(len, o)) / t for (o, t, _), _ in passes),
        "speedup_vs_ar": statistics.median(pair_speedups),
        "decode_speedup_vs_ar": statistics.median(pair_decode),
        "repeats": repeats,
        "speedup_per_pass": pair_speedups,
        # the first pass's tau per batch of prompts (per prompt at batch 1) and its verify steps per
        # row: the tau of any subset of the prompts, row_steps-weighted, without another run
        "tau_per_batch": [r.tau for r in sp_res],
        "row_steps_per_batch": [r.row_steps for r in sp_res],
        **(verdict.record() if verdict is not None else {"verdict": None, "lossless": None}),
        "greedy_agreement": agree / len(ar_out) if sampling.greedy else None,
        "repeated_4grams": sum(r for r, _ in reps) / max(sum(t for _, t in reps), 1),  # of the AR outputs
        "ar_step_ms": ar_m["step_ms"],
        "verify_step_ms": m["verify_step_ms"],
        "propose_step_ms": m["propose_step_ms"],
        "prompt_draft_ms": m["prompt_draft_ms"],
        "prefill_ms": m["prefill_ms"],
        "ar_prefill_ms": ar_m["prefill_ms"],
        "draft_step_ms": m["draft_step_ms"],
        "step_ms": m["step_ms"],
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(torch_dtype).replace("torch.", ""),
        "cuda_graphs": bool(graphs),
        "compiled": bool(spec.compile),
        "threads": torch.get_num_threads(),
        "git_commit": git_commit(),
        "date": today(),
    }
    if hf_baseline:
        fields["hf_tokens_per_s"] = sum(len(t) for t in hf_out) / hf_s
        fields["ar_vs_hf"] = (sum(map(len, ar_out)) / ar_s) / fields["hf_tokens_per_s"]  # the interleaved pass
        fields["hf_agreement"] = sum(a == b for a, b in zip(ar_out, hf_out)) / len(ar_out)
    record = new_record("bench", fields)
    if console is not None:
        print_table([record], console)
    if json_path:
        _write_record(json_path, record)
    return record


def tree_fields(tree: TreeSpec | None, tau: float) -> dict[str, Any]:
    """A tree record's settings (``trees.record_fields``), the tokens verified and accepted per
    round; nothing for a chain."""
    if tree is None:
        return {}
    fields = record_fields(tree)
    return {**fields, "verified_tokens": fields["draft_tokens"], "accepted_per_round": tau - 1}


def tree_label(record: dict[str, Any]) -> str:
    """The k column: k for a chain, topk,steps,tokens for a tree (static: "paths N")."""
    if "tree_paths" in record:
        return f"paths {record['draft_tokens'] - 1}"
    if "topk" in record:
        return f"{record['topk']},{record['steps']},{record['draft_tokens']}"
    return str(record["k"])


def _write_record(json_path: str, record: dict[str, Any]) -> None:
    """``--json F`` after the table: when F cannot be written, the record goes to a temporary file
    that the one-line error names, so that a long measurement is never lost."""
    try:
        write_records(json_path, [record])
    except OSError as e:
        try:
            fd, fallback = tempfile.mkstemp(prefix="outrider-bench-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps([record], indent=2) + "\n")
        except OSError:
            raise UserError(f"cannot write --json {os_error_line(e, json_path)}; the measurements are in the table "
                            "above") from None
        raise UserError(f"cannot write --json {os_error_line(e, json_path)}; the measurements were saved to "
                        f"{fallback}") from None


def verdict_cell(record: dict[str, Any]) -> str:
    """The lossless column: exact, ties N, NO, - (sampled), or reference (the plain decoding row)."""
    if record.get("method") == "ar":
        return "reference"
    text = record.get("verdict")
    if text is None:
        return "-" if record.get("lossless") is None else ("yes" if record["lossless"] else "NO")
    if text == "exact" or text.startswith("NO"):
        return text.split(":")[0]
    return f"ties {record.get('near_ties')}"


def print_table(records: list[dict[str, Any]], console) -> None:
    from rich.table import Table

    table = Table(title="outrider bench")
    for col in ("method", "k", "tau", "accept/pos", "tok/s", "AR tok/s", "speedup", "lossless", "repeats"):
        table.add_column(col, justify="right")
    for r in records:
        acc = " ".join(f"{a:.2f}" for a in r["accept_rate_per_pos"]) or "-"
        lossless = verdict_cell(r)
        table.add_row(r["method"], tree_label(r), f"{r['tau']:.2f}", acc, f"{r['tokens_per_s']:.1f}",
                      f"{r['ar_tokens_per_s']:.1f}", f"{r['speedup_vs_ar']:.2f}x", lossless,
                      f"{r['repeated_4grams']:.0%}" if "repeated_4grams" in r else "-")
    console.print(table)
    console.print("repeats: the share of the plain greedy outputs' 4-grams seen earlier in the same text "
                  "(looping text is easy to draft)")
    for r in records:
        if r.get("verdict") not in (None, "exact"):
            console.print(f"{r['method']} {tree_label(r)}: lossless {r['verdict']}")
        if r.get("truncated_prompts"):
            console.print(f"{r['method']}: {r['truncated_prompts']} of {r['num_prompts']} prompts truncated to "
                          f"{r.get('max_prompt_tokens')} tokens (--max-prompt-tokens)")
        if r.get("repeated_prompts"):
            console.print(f"{r['method']}: {r['repeated_prompts']} prompt(s) skipped, the same tokens as an "
                          "earlier one")
    for r in records:
        if "hf_tokens_per_s" in r:
            console.print(f"transformers generate: {r['hf_tokens_per_s']:.1f} tok/s; "
                          f"our AR is {r['ar_vs_hf']:.2f}x of it")
