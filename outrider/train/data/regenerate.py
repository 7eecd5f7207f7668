"""Regeneration: each assistant turn replaced by the target's own reply, locally or through a server.

Contract: turns are regenerated in order, each reply the context of the next: greedy, or sampled
at a temperature (no top-k or top-p) with per-request seeds, through a local
``generate_fn(prompts, max_new_tokens)`` (token ids in, new token ids out; prompts go in waves of
similar length) or an OpenAI-compatible server (vLLM, SGLang). Finished conversations are appended
to a JSONL cache next to the output (``<out>.regen.jsonl``) and reused on a rerun with the same
settings, so an interrupted run resumes. A reply cut at ``max_new_tokens`` is stored as if it had
ended there; turns whose prompt already fills ``max_length`` are not generated; server-side
refusals (HTTP 4xx) end that conversation at the refused turn: the conversations so cut short are
counted (``truncated_by_server``; none kept: ``dropped`` ``server_rejected``), the server's first
reason (status and message) is kept (``server_refusal``), and a refused conversation is not
replayed from the cache: the next run asks the server again. Under a time budget conversations go
in chunks in the order given and the ones no chunk reached are dropped (``over_budget``): a rerun
finds the finished ones in the cache and goes on from there."""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from outrider.ops.seeds import derived_seed
from outrider.models import input_device, load_model
from outrider.progress import Bar
from outrider.train.data.conversations import Conversation, Dropped
from outrider.interop.openai_client import ChatClient, ServerRejected
from outrider.train.data.template import encode, render

GenerateFn = Callable[[list[list[int]], int], list[list[int]]]  # prompts' token ids, max new -> new ids
BUDGET_CHUNK = 2048  # conversations per chunk under a time budget (at least 4 batches or 4 rounds of requests)


# --------------------------------------------------------------------------------------------
# Regeneration: the target's own replies, locally or through a server


class _Cache:
    """Append-only JSONL of finished conversations: ``{conv_id, key, responses, stop}``."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._file = None
        if path.exists():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by an interrupted run
                    continue
                if isinstance(entry, dict) and "conv_id" in entry and isinstance(entry.get("responses"), list):
                    self.entries[str(entry["conv_id"])] = entry

    def get(self, conv_id: str, key: str) -> dict[str, Any] | None:
        entry = self.entries.get(conv_id)
        return entry if entry is not None and entry.get("key") == key else None

    def put(self, conv_id: str, key: str, responses: list[str], stop: str | None) -> None:
        entry = {"conv_id": conv_id, "key": key, "responses": responses, "stop": stop}
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a+b")
                self._file.seek(0, 2)
                if self._file.tell() > 0:
                    self._file.seek(-1, 2)
                    if self._file.read(1) != b"\n":
                        self._file.write(b"\n")
            self._file.write((json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8"))
            self._file.flush()
            self.entries[conv_id] = entry

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _apply_responses(messages: list[dict[str, str]], responses: list[str]) -> list[dict[str, str]]:
    """Replace the first ``len(responses)`` assistant turns; cut everything after the last one."""
    out, k = [], 0
    for m in messages:
        if m["role"] == "assistant":
            if k == len(responses):
                break
            out.append({"role": "assistant", "content": responses[k]})
            k += 1
        else:
            out.append(dict(m))
    while out and out[-1]["role"] != "assistant":
        out.pop()
    return out


def _cut_at_end(ids: Sequence[int], end: set[int]) -> list[int]:
    out = []
    for t in ids:
        if t in end:
            break
        out.append(int(t))
    return out


ROW_STEP = 32  # a batch cut by its positions keeps a multiple of this many rows: few batch sizes, few target caches


def regen_batches(lengths: Sequence[int], batch_size: int, max_batch_tokens: int = 0, max_new_tokens: int = 0
                  ) -> list[list[int]]:
    """Prompt indices in batches, shortest prompts first: at most ``batch_size`` rows and, with
    ``max_batch_tokens`` > 0, at most that many positions (rows x (the batch's longest prompt +
    ``max_new_tokens``)); a batch the positions cut to more than ``ROW_STEP`` rows keeps a multiple
    of ``ROW_STEP`` (each batch size holds a target cache of its own in the engine's pool)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])  # similar lengths per batch
    out, s = [], 0
    while s < len(order):
        n = min(batch_size, len(order) - s)
        if max_batch_tokens:  # the rows whose longest (last) prompt still fits, one at least
            fit = 1
            while fit < n and (fit + 1) * (lengths[order[s + fit]] + max_new_tokens) <= max_batch_tokens:
                fit += 1
            n = fit if fit == n or fit <= ROW_STEP else fit - fit % ROW_STEP
        out.append(order[s:s + n])
        s += n
    return out


def hf_generate_fn(model, pad_token_id: int, end_ids: Iterable[int], batch_size: int = 8,
                   temperature: float = 0.0, seed: int = 0) -> GenerateFn:
    """A ``generate_fn`` from a Hugging Face causal LM: ``model.generate``, left-padded batches; greedy,
    or sampled at ``temperature`` (> 0) from the whole distribution, batch i drawing from the
    model device's default generator seeded ``derived_seed(seed, i)`` (restored afterwards)."""
    from transformers import GenerationConfig

    end = sorted(set(int(e) for e in end_ids))
    batches = 0  # batches generated so far: the next one's seed offset

    def generate(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        nonlocal batches
        device = input_device(model)
        cuda = device.type == "cuda"
        index = torch.cuda.current_device() if cuda and device.index is None else device.index
        out: list[list[int]] = [[] for _ in prompts]
        sampled = {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0,
                   "typical_p": 1.0, "repetition_penalty": 1.0}  # none of the model's own settings
        config = GenerationConfig(**(sampled if temperature > 0 else {"do_sample": False}),
                                  max_new_tokens=int(max_new_tokens), pad_token_id=pad_token_id,
                                  eos_token_id=end or None)
        for chunk in regen_batches([len(p) for p in prompts], batch_size):
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)  # [batch, seq]
            attn = torch.zeros((len(chunk), width), dtype=torch.long)  # [batch, seq]
            for row, i in enumerate(chunk):
                n = len(prompts[i])
                ids[row, width - n:] = torch.tensor(prompts[i], dtype=torch.long)
                attn[row, width - n:] = 1
            with torch.no_grad(), torch.random.fork_rng(devices=[index] if cuda else []):
                # only the generator that samples is reseeded: the one fork_rng restores
                gen_state = torch.cuda.default_generators[index] if cuda else torch.default_generator
                gen_state.manual_seed(derived_seed(seed, batches, 63))
                gen = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                     generation_config=config)  # [batch, width + new]
            batches += 1
            for row, i in enumerate(chunk):
                out[i] = [int(t) for t in gen[row, width:].tolist()]
        return out

    generate.batch_size = batch_size  # the regeneration's wave size
    generate.temperature = float(temperature)
    generate.seed = seed
    return generate


@dataclass
class _RegenResult:
    responses: list[str]
    stop: str | None  # why it stopped before the last assistant turn: max_length, server_rejected, ...
    reason: str = ""  # the server's own words for a refusal: "HTTP 400: ..."


def _regen_local(todo: list[tuple[Conversation, str]], tokenizer, generate_fn: GenerateFn, max_new_tokens: int,
                 max_length: int, end: set[int], cache: _Cache, bar: Bar, wave: int = 64) -> dict[str, _RegenResult]:
    """Turn by turn, batched across conversations: round r generates every conversation's r-th reply."""
    results: dict[str, _RegenResult] = {}

    def finish(conv: Conversation, key: str, responses: list[str], stop: str | None) -> None:
        cache.put(conv.conv_id, key, responses, stop)
        results[conv.conv_id] = _RegenResult(responses, stop)
        bar.advance()

    active = [(conv, key, copy.deepcopy(conv.messages), [i for i, m in enumerate(conv.messages)
                                                           if m["role"] == "assistant"], [])
              for conv, key in todo]
    while active:
        ready = []
        for state in active:
            conv, key, msgs, turns, responses = state
            i = turns[len(responses)]
            try:
                prompt = encode(tokenizer, render(tokenizer, msgs[:i], True))
            except Dropped as d:
                finish(conv, key, responses, d.reason)
                continue
            if len(prompt) >= max_length:
                finish(conv, key, responses, "max_length")
                continue
            ready.append((state, i, prompt))
        active = []
        ready.sort(key=lambda r: len(r[2]))  # waves of similar lengths: little padding, steady cache sizes
        wave = getattr(generate_fn, "batch_size", wave)  # one wave = one batch of the generator
        for start in range(0, len(ready), wave):
            chunk = ready[start: start + wave]
            outs = generate_fn([p for _, _, p in chunk], max_new_tokens)
            if len(outs) != len(chunk):
                raise RuntimeError(f"generate_fn returned {len(outs)} outputs for {len(chunk)} prompts")
            for (state, i, _), out in zip(chunk, outs):
                conv, key, msgs, turns, responses = state
                text = tokenizer.decode(_cut_at_end(out, end), skip_special_tokens=True)
                msgs[i] = {"role": "assistant", "content": text}
                responses.append(text)
                if len(responses) == len(turns):
                    finish(conv, key, responses, None)
                else:
                    active.append(state)
    return results


def _regen_server(todo: list[tuple[Conversation, str]], tokenizer, client, max_new_tokens: int, max_length: int,
                  concurrency: int, cache: _Cache, bar: Bar, temperature: float = 0.0,
                  seed: int = 0) -> dict[str, _RegenResult]:
    """One thread per conversation in flight; each conversation goes turn by turn."""
    tok_lock = threading.Lock()  # tokenizers are not guaranteed thread-safe

    def work(conv: Conversation, key: str) -> _RegenResult:
        msgs = copy.deepcopy(conv.messages)
        responses: list[str] = []
        stop, reason = None, ""
        for i, m in enumerate(conv.messages):
            if m["role"] != "assistant":
                continue
            with tok_lock:
                try:
                    n_prompt = len(encode(tokenizer, render(tokenizer, msgs[:i], True)))
                except Dropped as d:
                    stop = d.reason
                    break
            if n_prompt >= max_length:
                stop = "max_length"
                break
            try:
                text = client.chat(msgs[:i], max_new_tokens, temperature,
                                   seed=derived_seed(seed, f"{key}:{i}", 31) if temperature else None)
            except ServerRejected as e:
                stop, reason = "server_rejected", str(e)
                break
            msgs[i] = {"role": "assistant", "content": text}
            responses.append(text)
        cache.put(conv.conv_id, key, responses, stop)
        return _RegenResult(responses, stop, reason)

    results: dict[str, _RegenResult] = {}
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        futures = {pool.submit(work, conv, key): conv.conv_id for conv, key in todo}
        for fut in as_completed(futures):
            results[futures[fut]] = fut.result()
            bar.advance()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results


def _regen_key(backend: str, conv: Conversation, max_new_tokens: int, max_length: int, template_hash: str,
               temperature: float = 0.0, seed: int = 0) -> str:
    # greedy keys stay as they were before sampling existed, so that earlier caches still serve
    sampled = [temperature, seed] if temperature else []
    settings = [backend, conv.messages, max_new_tokens, max_length, template_hash] + sampled
    blob = json.dumps(settings, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:20]


def cache_path_for(out: str | Path) -> Path:
    """Where the regeneration cache of an output directory lives (a sibling, kept across runs)."""
    out = Path(out).expanduser()
    return out.parent / f"{out.name}.regen.jsonl"


def pad_id(tokenizer, end: set[int]) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(end, default=0))


def regenerate_conversations(conversations: list[Conversation], tokenizer, target: str, model_path: Path, end: set[int],
                template_hash: str, out_path: Path, server: str | None, server_model: str | None,
                concurrency: int, max_new_tokens: int, max_length: int, progress: bool,
                generate_fn: GenerateFn | None, client_options: dict[str, Any],
                dropped: Counter, temperature: float = 0.0, seed: int = 0,
                placement: tuple[Any, Any] = (None, None), budget_s: float = 0.0
                ) -> tuple[list[Conversation], dict[str, Any]]:
    """Replace assistant turns with the target's replies; cached conversations are not regenerated.
    ``budget_s`` > 0: conversations go in chunks, in the order given, and no chunk starts that the
    last one's pace says would end past the budget; the ones left are dropped (``over_budget``)."""
    if generate_fn is not None:
        fn_t, fn_seed = float(getattr(generate_fn, "temperature", 0.0)), getattr(generate_fn, "seed", 0)
        if fn_t != temperature or (temperature and fn_seed != seed):
            raise ValueError(f"generate_fn samples at temperature {fn_t} (seed {fn_seed}), the data was asked "
                             f"at {temperature} (seed {seed})")
    cache_file = cache_path_for(out_path)
    cache = _Cache(cache_file)
    client = None
    if server:
        client = ChatClient(server, server_model, **client_options)
        backend, model_name = "server", client.check()
    else:
        backend, model_name = "local", str(model_path)
    results: dict[str, _RegenResult] = {}
    todo = []
    for conv in conversations:
        key = _regen_key(f"{backend}:{model_name}", conv, max_new_tokens, max_length, template_hash, temperature,
                         seed)
        hit = cache.get(conv.conv_id, key)
        if hit is not None and hit.get("stop") != "server_rejected":  # a refusal is asked again, not replayed
            results[conv.conv_id] = _RegenResult(list(hit["responses"]), hit.get("stop"))
        else:
            todo.append((conv, key))
    from_cache = len(results)
    start = time.perf_counter()
    try:
        with Bar(progress, "regenerating", len(todo)) as bar:
            if todo and client is None and generate_fn is None:
                model, _ = load_model(target, with_tokenizer=False, device_map=placement[0],
                                      offload_folder=placement[1])
                generate_fn = hf_generate_fn(model, pad_id(tokenizer, end), end, temperature=temperature, seed=seed)
            per_call = concurrency if client is not None else getattr(generate_fn, "batch_size", 1)
            size = max(BUDGET_CHUNK, 4 * per_call) if budget_s > 0 else max(len(todo), 1)
            pace = 0.0  # seconds the last chunk took
            for at in range(0, len(todo), size):
                if budget_s > 0 and at and time.perf_counter() - start + pace > budget_s:
                    break
                t = time.perf_counter()
                chunk = todo[at: at + size]
                if client is not None:
                    results.update(_regen_server(chunk, tokenizer, client, max_new_tokens, max_length, concurrency,
                                                 cache, bar, temperature, seed))
                else:
                    results.update(_regen_local(chunk, tokenizer, generate_fn, max_new_tokens, max_length, end,
                                                cache, bar))
                pace = time.perf_counter() - t
    finally:
        cache.close()
    out, cut_short = [], 0
    refusals = [r.reason for r in results.values() if r.stop == "server_rejected" and r.reason]
    over_budget = sum(conv.conv_id not in results for conv in conversations)
    if over_budget:
        dropped["over_budget"] += over_budget
    for conv in conversations:
        res = results.get(conv.conv_id)
        if res is None:
            continue
        cut_short += bool(res.responses) and res.stop == "server_rejected"
        if not res.responses:
            dropped["nothing_to_learn" if res.stop in (None, "max_length") else res.stop] += 1
            continue
        out.append(Conversation(conv.conv_id, _apply_responses(conv.messages, res.responses)))
    info = {"backend": backend, "model": model_name, "server": server, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "seed": seed if temperature else None, "cache": str(cache_file),
            "from_cache": from_cache, "conversations": len(out), "truncated_by_server": cut_short,
            "server_refusal": refusals[0] if refusals else None}
    if budget_s > 0:
        info.update(budget_s=budget_s, over_budget=over_budget, seconds=round(time.perf_counter() - start, 1))
    if getattr(generate_fn, "splits", 0):  # batches the device had no memory for, run again as halves
        info["batches_halved"] = generate_fn.splits
    return out, info
