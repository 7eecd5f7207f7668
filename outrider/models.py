"""Load targets and drafts; summarise their architecture; capture auxiliary hidden states.

Contract:
- A model spec is a local Hugging Face causal-LM folder, a ``.gguf`` file, or the alias
  ``default`` (the embedded SmolLM2-135M-Instruct, converted by ``outrider pull``).
- ``arch_info`` reads a config (object or plain dict, so config-only folders and wrapper
  configs such as Kimi-K2.5's ``kimi_k25`` with its ``text_config`` work) into ``ArchInfo``.
- ``load_model`` returns ``(model, tokenizer)`` in eval mode, float32 on CPU and bfloat16 on
  CUDA unless told otherwise. Every failure a user can fix is a ``UserError``.
- ``AuxCapture`` records, by forward pre-hooks, the hidden state *entering* decoder layer ``j``
  for each requested id ``j`` (= Hugging Face ``output_hidden_states[j]``); id ``L`` (the number
  of layers) is the last layer's output before the final norm, by a forward hook on that layer.
  No modeling file is forked; the hooks work for any model whose decoder layers sit in
  ``model.model.layers``.

- ``load_model(..., device_map=...)`` places a target through accelerate (several GPUs, CPU and
  disk offload); ``resident_weight`` reads an offloaded parameter, ``input_device`` says where
  the ids go.

Not done here: quantised (INT4/FP8) loading (layer streaming, ``outrider.train.states.stream``, reads
INT4 checkpoints), tensor parallelism, downloading from a hub.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import inspect
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from outrider import assets
from outrider.errors import UserError
from outrider.fsutil import read_json, read_json_object, read_text

DEFAULT_ALIAS = "default"


@dataclass(frozen=True)
class ArchInfo:
    """What speculative decoding needs to know about a causal LM, from its config alone."""

    model_type: str
    architectures: tuple[str, ...]
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention: str  # "MHA" | "GQA" | "MQA" | "MLA"
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int = 0  # routed experts; 0 for a dense model
    experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_dense_layers: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    num_mtp_layers: int = 0  # DeepSeek-V3 ``num_nextn_predict_layers``
    dtype: str = ""
    quantization: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return max(0, self.num_layers - self.first_dense_layers) if self.is_moe else 0

    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        """EAGLE-3's default aux ids ``(2, L//2, L-3)``, as vLLM and SGLang default."""
        L = self.num_layers
        return (2, L // 2, L - 3)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["architectures"] = list(self.architectures)
        d["is_moe"] = self.is_moe
        return d


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Unwrap multimodal wrappers (Kimi-K2.5 ``kimi_k25``, Llava-style) to the text model's config."""
    for key in ("text_config", "language_config", "llm_config"):
        inner = cfg.get(key)
        if isinstance(inner, dict) and inner.get("hidden_size"):
            merged = dict(inner)
            merged.setdefault("architectures", cfg.get("architectures"))
            merged.setdefault("torch_dtype", cfg.get("torch_dtype") or cfg.get("dtype"))
            merged.setdefault("quantization_config", cfg.get("quantization_config"))
            return merged
    return cfg


def arch_info(config: Any) -> ArchInfo:
    """Summarise a config (a ``PretrainedConfig`` or a config.json dict)."""
    cfg = config if isinstance(config, dict) else config.to_dict()
    cfg = _text_config(cfg)

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise UserError(f"config has no '{key}': not a causal-LM config outrider understands")
        return cfg[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    kv_lora = int(cfg.get("kv_lora_rank") or 0)
    if kv_lora:
        attention = "MLA"
    elif kv_heads == heads:
        attention = "MHA"
    elif kv_heads == 1:
        attention = "MQA"
    else:
        attention = "GQA"
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    quant = cfg.get("quantization_config") or {}
    quant_name = ""
    if isinstance(quant, dict) and quant:
        quant_name = str(quant.get("quant_method") or quant.get("format") or "custom")
        bits = quant.get("bits") or (quant.get("config_groups", {}) or {}).get("group_0", {}).get("weights", {}).get("num_bits")
        if bits:
            quant_name += f"-int{bits}" if "int" not in quant_name else ""
    return ArchInfo(
        model_type=str(cfg.get("model_type", "")),
        architectures=tuple(cfg.get("architectures") or ()),
        num_layers=int(need("num_hidden_layers")),
        hidden_size=hidden,
        vocab_size=int(need("vocab_size")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        attention=attention,
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_experts=experts,
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        num_shared_experts=int(cfg.get("n_shared_experts") or 0) if experts else 0,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
        first_dense_layers=int(cfg.get("first_k_dense_replace") or 0) if experts else 0,
        kv_lora_rank=kv_lora,
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0),
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or ""),
        quantization=quant_name,
    )


def resolve(spec: str | Path) -> Path:
    """Turn a model spec into a local path (a folder or a .gguf file); ``default`` must be pulled."""
    if str(spec) == DEFAULT_ALIAS:
        path = assets.default_model_dir()
        if not (path / "config.json").exists():
            raise UserError("the default model is not in the cache: run `outrider pull` first")
        return path
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"model not found: {path} (give a Hugging Face model folder, a .gguf file or 'default')")
    if path.is_dir() and not (path / "config.json").exists():
        raise UserError(f"{path} has no config.json: not a Hugging Face model folder")
    if path.is_file() and path.suffix != ".gguf":
        raise UserError(f"{path} is a file but not a .gguf: give a model folder or a GGUF file")
    return path


def load_config_dict(spec: str | Path) -> dict[str, Any]:
    """config.json of a folder as a dict (works without weights)."""
    path = resolve(spec)
    if path.is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    cfg = read_json(path / "config.json")
    if not isinstance(cfg, dict):
        raise UserError(f"{path / 'config.json'} is not a model config (a JSON object), it is a {type(cfg).__name__}")
    return cfg


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def parse_dtype(name: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    if name is None or name == "auto":
        return default_dtype(device)
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise UserError(f"unknown dtype '{name}': use one of {', '.join(sorted(table))}")
    return table[name]


def load_tokenizer(spec: str | Path):
    from transformers import AutoTokenizer

    path = resolve(spec)
    try:
        if path.is_file():
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the tokenizer of {path}: {str(e).splitlines()[0]}") from None


DEVICE_MAP_NAMES = ("auto", "balanced", "balanced_low_0", "sequential")


def parse_device_map(text: str | dict | None) -> str | dict | None:
    """``--device-map``: ``auto``, ``balanced`` (also ``balanced_low_0``, ``sequential``), a JSON
    object ``{"module name": device}`` (devices: a GPU index, ``"cuda:1"``, ``"cpu"``, ``"disk"``)
    or a file holding one. Returned as accelerate takes it."""
    if text is None or isinstance(text, dict):
        return text
    text = str(text).strip()
    if text in DEVICE_MAP_NAMES:
        return text
    source = text
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise UserError(f"--device-map '{text}' is neither {', '.join(DEVICE_MAP_NAMES)}, a JSON object nor a "
                            "JSON file")
        source = read_text(path)
    try:
        mapping = json.loads(source)
    except json.JSONDecodeError as e:
        raise UserError(f"--device-map is not valid JSON: {e}") from None
    if not isinstance(mapping, dict) or not mapping:
        raise UserError("--device-map JSON must be an object {\"module name\": device, ...}")
    for name, dev in mapping.items():
        ok = isinstance(dev, int) or (isinstance(dev, str) and (dev in ("cpu", "disk", "meta") or dev.startswith(
            ("cuda", "xpu", "mps"))))
        if not ok:
            raise UserError(f"--device-map: '{name}' maps to {dev!r}; use a GPU index, 'cuda:N', 'cpu' or 'disk'")
    return mapping


def is_dispatched(model: torch.nn.Module) -> bool:
    """Was ``model`` placed by accelerate (``device_map``) rather than moved whole to one device?"""
    return bool(getattr(model, "hf_device_map", None))


def resident_weight(module: torch.nn.Module, name: str = "weight") -> torch.Tensor:
    """``module.<name>`` as a real tensor, also when accelerate offloaded it (meta + its hook's weights)."""
    tensor = getattr(module, name)
    if tensor.device.type != "meta":
        return tensor
    weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
    if weights is None:
        raise UserError(f"{type(module).__name__}.{name} is on the meta device with no offloaded copy: the model "
                        "was not fully loaded")
    return weights[name]


def input_device(model: torch.nn.Module) -> torch.device:
    """Where a model's input ids go: the device of its first parameter, or for a dispatched model
    the device its embedding executes on (offloaded embeddings take their inputs on the CPU)."""
    if is_dispatched(model):
        embed = model.get_input_embeddings()
        hook = getattr(embed, "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
        weight = embed.weight
        return weight.device if weight.device.type != "meta" else torch.device("cpu")
    return next(model.parameters()).device


def load_model(spec: str | Path, device: torch.device | str | None = None,
               dtype: str | torch.dtype | None = None, with_tokenizer: bool = True,
               device_map: str | dict | None = None, offload_folder: str | Path | None = None,
               max_memory: dict | None = None):
    """Load a causal LM for inference. Returns ``(model, tokenizer or None)``.

    ``device_map`` (``parse_device_map``): placed by accelerate across GPUs, the CPU and the disk
    (``offload_folder``, a temporary folder removed at exit when not given) instead of moved whole
    to ``device``; the dtype then defaults to ``device``'s.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    path = resolve(spec)
    device = torch.device(device) if device is not None else default_device()
    torch_dtype = parse_dtype(dtype, device)
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    device_map = parse_device_map(device_map)
    if device_map is not None:
        _check_map_devices(device_map)
        kwargs["device_map"] = device_map
        kwargs["offload_folder"] = str(offload_folder) if offload_folder is not None else _temporary_offload_folder()
        if max_memory is not None:  # the devices (and bytes) accelerate may use, e.g. one rank's GPUs
            kwargs["max_memory"] = max_memory
    try:
        if path.is_file():
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except SafetensorError as e:
        raise UserError(f"cannot read the weights of {path}: {e} (the file is corrupt or truncated)") from None
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first if len(first) <= 300 else first[:300] + "..."
        raise UserError(f"cannot load the model at {path}: {first}") from None
    if device_map is None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    tokenizer = load_tokenizer(spec) if with_tokenizer else None
    return model, tokenizer


def _check_map_devices(device_map: str | dict) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    values = device_map.values() if isinstance(device_map, dict) else ()
    for dev in values:
        index = dev if isinstance(dev, int) else (int(dev.split(":")[1]) if str(dev).startswith("cuda:")
                                                  else 0 if dev == "cuda" else None)
        if index is not None and index >= gpus:
            raise UserError(f"--device-map places modules on GPU {index}, but this machine has {gpus} GPU(s)")


def _temporary_offload_folder() -> str:
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="outrider-offload-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        layers = getattr(getattr(inner, "language_model", None), "layers", None)
    if layers is None:
        raise UserError(f"{type(model).__name__} has no model.layers: cannot capture hidden states")
    return layers


def check_aux_ids(layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Aux ids in 0..L (``L`` = the last layer's output, pre-norm)."""
    ids = tuple(int(j) for j in layer_ids)
    bad = [j for j in ids if not 0 <= j <= num_layers]
    if bad:
        raise UserError(f"aux layer ids {bad} out of range: the target has {num_layers} layers (ids 0..{num_layers}, "
                        f"{num_layers} = the last layer's output)")
    return ids


class AuxCapture:
    """Capture the hidden states entering chosen decoder layers during every forward.

    Usage::

        cap = AuxCapture(model, (2, 15, 27))
        model(...)
        aux = cap.concat()  # [batch, seq, len(ids) * hidden], ids in the given order

    The capture stays attached until ``close()``; each forward overwrites the last one. With
    ``attach=False`` its hooks are on only inside ``with cap.attached():``, so that several
    captures of one model (one per cache) neither run each other's hooks nor change what a
    compiled step of the model guards on.
    """

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int], attach: bool = True):
        self.layers = decoder_layers(model)
        self.layer_ids = check_aux_ids(layer_ids, len(self.layers))
        self.states: dict[int, torch.Tensor] = {}
        self._handles = []
        if attach:
            self._attach()

    def _attach(self) -> None:
        last = len(self.layers)
        for j in sorted(set(self.layer_ids)):
            if j == last:  # the last layer's output, before the model's final norm
                self._handles.append(self.layers[j - 1].register_forward_hook(self._out_hook(j)))
            else:
                self._handles.append(self.layers[j].register_forward_pre_hook(self._hook(j), with_kwargs=True))

    @contextlib.contextmanager
    def attached(self):
        """The hooks on for the block (already attached: nothing changes)."""
        if self._handles:
            yield self
            return
        self._attach()
        try:
            yield self
        finally:
            self.close()

    def _hook(self, j: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.states[j] = hidden  # [batch, seq, hidden]
        return hook

    def _out_hook(self, j: int):
        def hook(module, args, output):
            self.states[j] = output[0] if isinstance(output, (tuple, list)) else output  # [batch, seq, hidden]
        return hook

    def concat(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The captured states in the given id order, [batch, seq, n*hidden] (into ``out`` if given;
        layers placed on several devices: on ``out``'s, else the first state's)."""
        device = out.device if out is not None else self.states[self.layer_ids[0]].device
        return torch.cat([self.states[j].to(device) for j in self.layer_ids], dim=-1, out=out)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "AuxCapture":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Names and tokenizer fingerprints
# --------------------------------------------------------------------------------------------

def target_name(path: Path, cfg: dict[str, Any]) -> str:
    """A model's name: its config's hub id when it records one, else the folder (or file) name."""
    name = str(cfg.get("_name_or_path") or cfg.get("name_or_path") or "")
    if name and not Path(name).is_absolute() and not Path(name).exists() and "/" in name:
        return name
    return path.stem if path.is_file() else path.name


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_fingerprint(folder: str | Path) -> dict[str, Any]:
    """Hashes that identify a tokenizer: ``vocab_sha256`` (id<->token table, and BPE merges),
    ``specials_sha256`` (special tokens), ``chat_template_sha256``; plus ``kind``, ``vocab_size``
    and, when the vocabulary cannot be read, a ``note`` saying why. Reads files only."""
    folder = Path(folder)
    out: dict[str, Any] = {"kind": None}
    tc = read_json_object(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").exists() else {}
    specials: dict[str, Any] = {k: _token_text(tc.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                                if _token_text(tc.get(k))}
    added = {str(i): _token_text(v) for i, v in (tc.get("added_tokens_decoder") or {}).items()
             if isinstance(v, dict) and v.get("special")}
    if (folder / "tokenizer.json").exists():
        tok = read_json_object(folder / "tokenizer.json")
        model = tok.get("model") or {}
        vocab = model.get("vocab")
        if isinstance(vocab, dict):
            table = sorted((int(i), t) for t, i in vocab.items())
        elif isinstance(vocab, list):  # Unigram: [[token, score], ...], id = position
            table = [(i, entry[0] if isinstance(entry, list) else entry) for i, entry in enumerate(vocab)]
        else:
            table = []
        extra = [(int(t["id"]), t["content"]) for t in tok.get("added_tokens") or [] if "id" in t]
        added.update({str(t["id"]): t["content"] for t in tok.get("added_tokens") or [] if t.get("special")})
        table = sorted(set(table) | set(extra))
        out.update(kind="tokenizer.json", vocab_size=len({i for i, _ in table}),
                   vocab_sha256=_sha([table, model.get("merges") or []]))
    elif (folder / "tiktoken.model").exists():
        out["kind"] = "tiktoken"
        try:
            from tiktoken.load import load_tiktoken_bpe
        except ImportError:
            out["note"] = "tiktoken is not installed (pip install tiktoken): the tiktoken vocabulary was not read"
        else:
            try:
                ranks = load_tiktoken_bpe(str(folder / "tiktoken.model"))
            except (OSError, ValueError) as e:
                raise UserError(f"cannot read {folder / 'tiktoken.model'}: {e}") from None
            table = sorted((rank, base64.b64encode(token).decode()) for token, rank in ranks.items())
            extra = sorted((int(i), t) for i, t in added.items())
            out.update(vocab_size=len(table) + len(extra), vocab_sha256=_sha([table, extra]))
    else:
        files = [n for n in ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt") if (folder / n).exists()]
        if files:
            digest = hashlib.sha256()
            for n in files:
                digest.update((folder / n).read_bytes())
            out.update(kind="+".join(files), vocab_sha256=digest.hexdigest())
        else:
            out["note"] = "no tokenizer files"
    if added:
        specials["added"] = dict(sorted(added.items(), key=lambda kv: int(kv[0])))
    if specials:
        out["special_tokens"] = specials
        out["specials_sha256"] = _sha(specials)
    template = tc.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    if template is None and (folder / "chat_template.json").exists():
        template = read_json_object(folder / "chat_template.json").get("chat_template")
    if template is not None:
        out["chat_template_sha256"] = _sha(template)
    return out


def cache_parameter(fn: Any) -> str:
    """The name under which this transformers version's ``fn`` (a model's ``forward``, the mask
    builders) takes the cache: ``cache`` in recent 5.x releases, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"
