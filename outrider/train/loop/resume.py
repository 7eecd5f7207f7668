"""Resume only the run that was: what a resumed run must share with its checkpoint.

Contract:
- ``settings(state, ...)`` -> (config, preset): a resume runs with the checkpoint's settings; a
  ``--preset``/``--config`` that differs, other ``--aux-layers``, ``--init`` or another number of
  processes is refused with one line.
- ``identity(...)`` -> the run's identity: everything besides the config that changes its result.
  ``data``: sha256 of a token dataset's ``manifest.json`` and shards, or of a cache's header and
  manifest (each shard's own sha256 is in the manifest and checked when read), or of a peer
  cache's file names and sizes; ``template``: the chat template's hash the data was rendered
  with; ``source``: online, cache or streamed (with the streaming options); ``dtype``; ``aux_layers``;
  ``target``: a hash of the target's config; ``loss``: the config's loss settings. The checkpoint
  stores it (``trainer_state.pt``, and readable in ``trainer_state.json``).
- ``compare(saved, now, allowed)`` refuses the first difference not in ``allowed`` with one line
  that names it and the flag that allows it (``--allow-change NAME``); returns the allowed
  differences, which the trainer writes to its log. A checkpoint written before identities were
  stored is compared on nothing (its loss-token counts still are, by the trainer).
- ``resumed_line(...)``: the one line that says what was resumed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from outrider.config import TrainConfig, resolve_config
from outrider.errors import UserError

CONFIG_BOOKKEEPING = ("architectures", "transformers_version", "torch_dtype", "dtype", "name_or_path", "output_hidden_states",
                     "use_cache", "return_dict")
NAMES = ("source", "data", "template", "dtype", "aux_layers", "target", "loss")  # the first difference is named
LOSS_KEYS = ("ttt_steps", "step_decay", "loss_kernel", "amp", "max_length", "draft_vocab_size")
_HELP = {"data": "the training data's content", "template": "the chat template the data was rendered with",
         "source": "where the target's states come from (online, a cache, streamed)", "dtype": "the dtype",
         "aux_layers": "the aux layer ids", "target": "the target model's config", "loss": "the loss settings"}


def settings(state: dict[str, Any], preset: str | None, config: TrainConfig | str | None,
             aux_layer_ids: Sequence[int] | None, init: str | None, world_size: int,
             device_type: str, drafter: str | None = None) -> tuple[TrainConfig, str | None]:
    """The checkpoint's config and preset, after refusing flags that would change them."""
    saved = TrainConfig.from_dict(state["config"])
    if config is not None or preset is not None:
        asked, _ = resolve_config(preset, config, device_type, drafter)
        if asked.replace(aux_layer_ids=saved.aux_layer_ids) != saved:
            raise UserError("--resume continues with the checkpoint's settings: drop --preset/--config, "
                            "or train into a new --out")
    if aux_layer_ids is not None and tuple(sorted(aux_layer_ids)) != saved.aux_layer_ids:
        raise UserError(f"--aux-layers {list(aux_layer_ids)} differ from the checkpoint's "
                        f"{list(saved.aux_layer_ids)}: drop --aux-layers to resume")
    if init is not None:
        raise UserError("--init starts a new run from a head and --resume continues one: give only one")
    if int(state["world_size"]) != world_size:
        raise UserError(f"the checkpoint was written by {state['world_size']} process(es), this "
                        f"run has {world_size}: resume with the same --nproc-per-node")
    return saved, state.get("preset")


def _hash_files(paths: Sequence[Path], content: bool = True) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + str(p.stat().st_size).encode() + b"\0")
        if content:
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
    return h.hexdigest()


def _find(obj: Any, key: str) -> Any:
    """The first value under ``key`` anywhere in a JSON object."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            found = _find(v, key)
            if found is not None:
                return found
    return None


def data_identity(folder: str | Path) -> tuple[str, str | None]:
    """(content hash, chat-template hash or None) of a token dataset or a hidden-state cache."""
    root = Path(folder).expanduser()
    described = [root / n for n in ("manifest.json", "header.json") if (root / n).is_file()]
    ours_cache = (root / "header.json").is_file()
    if described and not ours_cache:  # a token dataset: its manifest and every shard
        shards = sorted(p for p in root.iterdir() if p.is_file() and p.suffix == ".parquet")
        digest = _hash_files(described + shards)
    elif ours_cache:  # the manifest holds each shard's sha256, checked as shards are read
        digest = _hash_files(described)
    else:  # a peer's cache: names and sizes (its files carry no checksums of their own)
        digest = _hash_files(sorted(p for p in root.rglob("*") if p.is_file()), content=False)
    template = None
    for p in described:
        try:
            template = template or _find(json.loads(p.read_text(encoding="utf-8")), "chat_template_hash")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            pass
    return digest, template


def identity(data: str | None, cache: str | None, stream: dict[str, Any] | None, dtype: Any,
             aux_layer_ids: Sequence[int] | None, target_config: Any, config: TrainConfig) -> dict[str, Any]:
    """What, besides the config, makes this run's result (see the module docstring); ``target_config``:
    a ``transformers`` config or its dict."""
    target_config = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    # the model's shape and numerics, not where it was read from, the library that wrote it or its dtype
    # (compared on its own): a target saved and read back is the same target
    target_config = {k: v for k, v in target_config.items() if k not in CONFIG_BOOKKEEPING and not k.startswith("_")}
    digest, template = data_identity(cache or data)
    source: Any = "cache" if cache else ("stream " + json.dumps(stream, sort_keys=True, default=str)
                                         if stream is not None else "online")
    cfg = config.to_dict()
    return {"data": digest, "template": template, "source": source, "dtype": str(dtype).replace("torch.", ""),
            "aux_layers": sorted(int(i) for i in aux_layer_ids) if aux_layer_ids is not None else None,
            "target": hashlib.sha256(json.dumps(target_config, sort_keys=True, default=str).encode()).hexdigest(),
            "loss": {k: cfg[k] for k in LOSS_KEYS if k in cfg}}


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str) if not isinstance(value, str) else value
    return text[:12] if len(text) == 64 else text[:80]


def compare(saved: dict[str, Any] | None, now: dict[str, Any], allowed: Sequence[str]) -> dict[str, Any]:
    """The differences ``allowed`` lets through ({name: [saved, now]}); one line for any other."""
    if not saved:
        return {}
    changed = {}
    for name in NAMES:
        if name in saved and saved[name] != now.get(name):
            if name not in allowed and "all" not in allowed:
                raise UserError(f"--resume: {_HELP[name]} changed since the checkpoint ({name} {_shown(saved[name])} "
                                f"then, {_shown(now.get(name))} now): resume with what the run had, train into a new "
                                f"--out, or pass --allow-change {name} to continue with the change on purpose "
                                "(it is logged)")
            changed[name] = [saved[name], now.get(name)]
    return changed


def resumed_line(out: Path, step: int, steps: int, ident: dict[str, Any], changed: dict[str, Any]) -> str:
    """One line: what was resumed (step, data, dtype, source) and any allowed change."""
    line = (f"resumed {out} at step {step} of {steps}: data {ident['data'][:12]}, dtype {ident['dtype']}, "
            f"source {str(ident['source']).split(' ')[0]}")
    if changed:
        line += "; changed on purpose (--allow-change): " + ", ".join(changed)
    return line
