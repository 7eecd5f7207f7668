"""The few tensors of a target that training from a cache needs, read lazily from its safetensors.

Contract: ``TargetWeights(spec)`` opens a target folder (``default`` or a Hugging Face folder with
``*.safetensors``, sharded or not) without building the model: only ``config.json``, the
safetensors headers (or ``model.safetensors.index.json``) and then the tensors asked for are
read, memory-mapped and sliced:
- ``embedding()`` [vocab, H]: the input embedding (frozen, the head's token embeddings);
- ``lm_head_rows(ids)`` [n, H] (and ``lm_head_bias(ids)``): rows of the output head, read in
  chunks (a tied head reads the embedding's rows), for the teacher over the draft vocabulary;
- ``final_norm()``: the target's final norm as its stock module (built from the config on the
  meta device, one decoder layer, then given its weight), for states stored before that norm;
- ``fingerprint()``: sha256 over the final norm weight and the first 64 embedding rows (as
  float32): a cache names the weights it came from, which config and tokenizer hashes cannot
  (two fine-tunes share both).
Names are matched by suffix (``embed_tokens.weight``, ``lm_head.weight``, ``model.norm.weight``),
so wrapped text models (Kimi-K2.5's ``language_model.``) are found too. GGUF targets and
non-float tensors are refused with one line.

Not done here: the decoder layers (``outrider.train.states.capture`` runs a loaded target), quantised heads.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from outrider.errors import UserError
from outrider.fsutil import safetensors_index
from outrider.models import load_config_dict, resolve

FINGERPRINT_ROWS = 64
CHUNK_ROWS = 4096


class TargetWeights:
    """Named tensors of a target folder's safetensors, opened lazily."""

    def __init__(self, spec: str | Path):
        self.path = resolve(spec)
        if self.path.is_file():
            raise UserError(f"{self.path} is a GGUF file: training from a cache reads the target's safetensors; "
                            "convert it to a Hugging Face folder (or use `outrider pull` for the default)")
        self.config = load_config_dict(spec)
        self.files = self._index()
        self._handles: dict[Path, Any] = {}

    def _index(self) -> dict[str, Path]:
        """Tensor name -> file."""
        from safetensors import SafetensorError, safe_open

        weight_map = safetensors_index(self.path)
        if weight_map is not None:
            return {name: self.path / file for name, file in weight_map.items()}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise UserError(f"{self.path} has no *.safetensors weights: training from a cache reads the target's "
                            "embedding and lm_head rows from them")
        names: dict[str, Path] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    names.update({k: file for k in f.keys()})
            except (SafetensorError, OSError) as e:
                raise UserError(f"cannot read the weights {file}: {e}") from None
        return names

    def _find(self, suffix: str, required: bool = True) -> str | None:
        hits = [k for k in self.files if (k == suffix or k.endswith("." + suffix)) and "visual" not in k
                and "vision" not in k]
        if not hits:
            if required:
                raise UserError(f"the target {self.path} has no tensor named *{suffix} in its safetensors")
            return None
        return min(hits, key=len)

    def _slice(self, name: str):
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        part = self._handles[file].get_slice(name)
        if part.get_dtype() not in ("F32", "F16", "BF16"):
            raise UserError(f"{name} of {self.path} is stored as {part.get_dtype()}: training from a cache needs "
                            "a float embedding and lm_head")
        return part

    def embedding(self) -> torch.Tensor:
        """[vocab, H] in the stored dtype."""
        return self._slice(self._find("embed_tokens.weight"))[:]

    def _lm_head_name(self) -> str:
        name = self._find("lm_head.weight", required=False)
        if name is None:
            if not self.config.get("tie_word_embeddings", False) and not _text(self.config).get("tie_word_embeddings"):
                raise UserError(f"the target {self.path} has no lm_head.weight and does not tie it to its embedding")
            name = self._find("embed_tokens.weight")
        return name

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [n] (ascending or not) of the output head: [n, H], read in chunks of rows."""
        part = self._slice(self._lm_head_name())
        return _rows(part, torch.as_tensor(ids, dtype=torch.long))

    def lm_head_bias(self, ids: torch.Tensor) -> torch.Tensor | None:
        name = self._find("lm_head.bias", required=False)
        if name is None:
            return None
        return self._slice(name)[:].index_select(0, torch.as_tensor(ids, dtype=torch.long))

    def norm_weight(self) -> torch.Tensor:
        """[H] the final norm's weight (``model.norm.weight``, not a layer's)."""
        hits = [k for k in self.files if k.endswith("norm.weight") and ".layers." not in k
                and (k == "model.norm.weight" or k.endswith(".model.norm.weight") or k == "norm.weight")]
        if not hits:
            raise UserError(f"the target {self.path} has no final norm weight (model.norm.weight)")
        return self._slice(min(hits, key=len))[:]

    def final_norm(self, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
        """The target's final norm as its stock module, with the stored weight (nothing else is built)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(self.path)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read the config of {self.path}: {str(e).splitlines()[0]}") from None
        text = config.get_text_config()
        text.num_hidden_layers = 1
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(text)
        norm = model.get_decoder().norm.to_empty(device=device)
        with torch.no_grad():
            norm.weight.copy_(self.norm_weight())
        return norm.to(dtype).eval().requires_grad_(False)

    def fingerprint(self) -> str:
        part = self._slice(self._find("embed_tokens.weight"))
        return weights_fingerprint(self.norm_weight(), part[:FINGERPRINT_ROWS])

    def close(self) -> None:
        self._handles.clear()


def weights_fingerprint(norm_weight: torch.Tensor, embedding_rows: torch.Tensor) -> str:
    """sha256 of the final norm weight and the first embedding rows, as float32."""
    h = hashlib.sha256(norm_weight.detach().float().cpu().contiguous().numpy().tobytes())
    h.update(embedding_rows[:FINGERPRINT_ROWS].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _text(config: dict[str, Any]) -> dict[str, Any]:
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(config.get(key), dict):
            return config[key]
    return config


def _rows(part: Any, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a safetensors slice of shape [V, H], reading only the chunks that hold some."""
    out = None
    V = part.get_shape()[0]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise UserError(f"token id {int(ids.max())} is outside the target's {V}-row lm_head")
    sorted_ids, order = ids.sort()
    starts = torch.div(sorted_ids, CHUNK_ROWS, rounding_mode="floor")
    for chunk in starts.unique().tolist():
        sel = (starts == chunk).nonzero().flatten()  # places in sorted_ids
        lo = chunk * CHUNK_ROWS
        block = part[lo:min(lo + CHUNK_ROWS, V)]  # [<=CHUNK_ROWS, H]
        rows = block.index_select(0, sorted_ids[sel] - lo)
        if out is None:
            out = rows.new_empty(ids.numel(), rows.shape[1])
        out[order[sel]] = rows
    if out is None:
        raise UserError("no lm_head rows asked for")
    return out
