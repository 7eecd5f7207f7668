"""Fault injection across every verb, as a user meets it: each case a fresh ``outrider`` process.

    python benchmarks/faults.py [--json FILE] [--only VERB,...] [--seed N]

Builds a tiny random target (``tests/tiny.py``) and one earlier output of every kind through the
CLI (a token dataset, a training run, its export, a hidden-state cache, a bench record), plus a
folder and a file of the user's. Then runs each scenario below as its own process: outputs of
another kind, foreign folders, inputs as outputs, file paths where folders belong; a second
writer on a locked output; full and read-only file systems (an ``OSError`` injected where the
verb writes, and a real tmpfs where this machine lets us mount one); outputs the OS refuses
(``/proc``, a device, a named pipe); SIGKILL, Ctrl-C and SIGTERM at a random point after the verb
holds its output, then the same command again (``--resume`` for train); numbers out of range and
inputs of the wrong kind; values inside inputs (a NaN head, a d2t past the vocabulary, token ids
past it in a dataset shard, an Inf in a cache shard whose checksum passes); a resume whose data,
dtype or source changed; text in another encoding; an empty ``HOME``; prompts fewer or longer than
asked and a plan whose KV cache does not fit (status 0 with the notice). A case is

- handled: the exit status is the promised one and, unless 0 (or 1: ``inspect``'s "not
  servable"), stderr has exactly one ``outrider VERB: ...`` line and no traceback (a rerun after
  a kill or a signal to train or capture must exit 0), and the expected notice where one is due;
- a traceback: ``Traceback`` on stderr;
- one line, exit 2: refused with status 2 and exactly one line (the rest: a signal's 130/143, a
  notice with status 0, inspect's 1, a rerun after SIGKILL);
- silent wrong: status 0 where a refusal was promised, or a notice that was due is missing;
- data lost: any earlier output (every file, the lock file excepted) is not byte-identical
  afterwards, or a folder replaced by a killed verb is not a complete output of its kind.

Prints a markdown table ``verb | faults tried | handled | one line, exit 2 | tracebacks | silent
wrong | data lost`` (and the cases not handled); ``--json FILE`` writes the table and every case.
Takes about 13 minutes on a 2-core CPU shared with other work.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from outrider.outputs import LOCK, wait_for_writer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

INJECT = """import errno, importlib, importlib.util, os, sys
where, how = sys.argv[1], sys.argv[2]
parts = where.split(".")
def importable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # below a module that is not a package
        return False
n = max(i for i in range(1, len(parts)) if importable(".".join(parts[:i])))
owner = importlib.import_module(".".join(parts[:n]))
for name in parts[n:-1]:  # an attribute path below the module: outrider.train.loop.checkpoint.torch.save
    owner = getattr(owner, name)
code = getattr(errno, how.split(":")[-1])
def fail(*args, **kwargs):
    if how.startswith("torch:"):  # what torch.save raises on a full disk: its own error over the OSError
        try:
            raise OSError(code, os.strerror(code))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    raise OSError(code, os.strerror(code), args[0] if args and isinstance(args[0], (str, os.PathLike)) else None)
setattr(owner, parts[-1], fail)
from outrider.cli import main
sys.exit(main(sys.argv[3:]))
"""
HOLD = """import sys, time
from outrider.outputs import claim_dir
with claim_dir(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)
"""


@dataclass
class Case:
    verb: str
    fault: str
    argv: list[str]
    status: int = 2  # the promised exit status
    inject: tuple[str, str] | None = None  # (module.attr, errno name or torch:ERRNO)
    signal: int | None = None  # sent at a random point after the output's lock is taken
    start_from: str | None = None  # an earlier output copied to {out} first
    holder: str | None = None  # another process holds {out} as this kind
    needs_mount: bool = False
    env: dict[str, str] | None = None  # environment variables set for this case
    expect: str | None = None  # a fragment stdout or stderr must hold (a status-0 case's notice)
    result: dict = field(default_factory=dict)


CASES = [
    # data
    Case("data", "--out a folder of the user's", ["data", "{target}", "--dataset", "{convs}", "--out", "{docs}"]),
    Case("data", "--dataset inside --out", ["data", "{target}", "--dataset", "{convs}", "--out", "{root}"]),
    Case("data", "--out a regular file", ["data", "{target}", "--dataset", "{convs}", "--out", "{file}"]),
    Case("data", "--out under a regular file", ["data", "{target}", "--dataset", "{convs}", "--out", "{file}/d"]),
    Case("data", "--out a training run", ["data", "{target}", "--dataset", "{convs}", "--out", "{run}"]),
    Case("data", "--out name too long", ["data", "{target}", "--dataset", "{convs}", "--out", "{tmp}/" + "n" * 300]),
    Case("data", "disk full while writing shards", ["data", "{target}", "--dataset", "{convs}", "--out", "{out}"],
         inject=("outrider.train.data.datasets._write_split", "ENOSPC"), start_from="data"),
    Case("data", "read-only output", ["data", "{target}", "--dataset", "{convs}", "--out", "{out}"],
         inject=("outrider.outputs._lock", "EROFS"), start_from="data"),
    Case("data", "real read-only mount", ["data", "{target}", "--dataset", "{convs}", "--out", "{ro}/data"],
         needs_mount=True),
    Case("data", "real full disk", ["data", "{target}", "--dataset", "{convs}", "--out", "{full}/data"],
         needs_mount=True),
    Case("data", "a second writer", ["data", "{target}", "--dataset", "{convs}", "--out", "{out}"], holder="dataset"),
    Case("data", "SIGKILL during --regenerate, rerun", ["data", "{target}", "--dataset", "{convs}", "--out", "{out}",
                                                        "--regenerate", "--max-new-tokens", "4",
                                                        "--max-conversations", "8", "--quiet"],
         status=0, signal=signal.SIGKILL, start_from="data"),
    Case("data", "Ctrl-C", ["data", "{target}", "--dataset", "{convs}", "--out", "{out}", "--regenerate",
                            "--max-new-tokens", "4", "--max-conversations", "8", "--quiet"],
         status=130, signal=signal.SIGINT, start_from="data"),
    Case("data", "--eval-fraction 1", ["data", "{target}", "--out", "{out}", "--eval-fraction", "1"]),
    Case("data", "--max-length 2", ["data", "{target}", "--out", "{out}", "--max-length", "2"]),
    Case("data", "SIGTERM during --regenerate", ["data", "{target}", "--dataset", "{convs}", "--out", "{out}",
                                                 "--regenerate", "--max-new-tokens", "4", "--max-conversations", "8",
                                                 "--quiet"], status=143, signal=signal.SIGTERM, start_from="data"),
    Case("data", "--out on /proc (the OS refuses the name)", ["data", "{target}", "--dataset", "{convs}", "--out",
                                                               "/proc/outrider-d"]),
    Case("data", "a Latin-1 dataset", ["data", "{target}", "--dataset", "{latin}", "--out", "{out}"]),
    # train
    Case("train", "--out the --data folder", ["train", "{target}", "--data", "{data}", "--out", "{data}"]),
    Case("train", "--force on a folder of the user's", ["train", "{target}", "--data", "{data}", "--out", "{docs}",
                                                        "--force"]),
    Case("train", "--force on an export", ["train", "{target}", "--data", "{data}", "--out", "{export}", "--force"]),
    Case("train", "an earlier run without --resume", ["train", "{target}", "--data", "{data}", "--out", "{run}",
                                                      "--config", "{cfg}"]),
    Case("train", "disk full at a checkpoint", ["train", "{target}", "--data", "{data}", "--out", "{out}",
                                                "--config", "{cfg}", "--quiet"],
         inject=("outrider.train.loop.checkpoint.torch.save", "torch:ENOSPC")),
    Case("train", "a second writer", ["train", "{target}", "--data", "{data}", "--out", "{out}", "--resume"],
         holder="run", start_from="run"),
    Case("train", "SIGKILL, then --resume", ["train", "{target}", "--data", "{data}", "--out", "{out}", "--config",
                                             "{cfg}", "--quiet"], status=0, signal=signal.SIGKILL),
    Case("train", "Ctrl-C", ["train", "{target}", "--data", "{data}", "--out", "{out}", "--config", "{cfg}",
                             "--quiet"], status=130, signal=signal.SIGINT),
    Case("train", "--max-steps 0", ["train", "{target}", "--data", "{data}", "--out", "{out}", "--max-steps", "0"]),
    Case("train", "--device cuda without CUDA", ["train", "{target}", "--data", "{data}", "--out", "{out}",
                                                 "--device", "cuda"]),
    Case("train", "--config a JSON list", ["train", "{target}", "--data", "{data}", "--out", "{out}", "--config",
                                           "{listjson}"]),
    Case("train", "SIGTERM, then --resume", ["train", "{target}", "--data", "{data}", "--out", "{out}", "--config",
                                             "{cfg}", "--quiet"], status=143, signal=signal.SIGTERM),
    Case("train", "--resume with other data", ["train", "{target}", "--data", "{data2}", "--out", "{out}", "--resume",
                                               "--quiet"], start_from="run"),
    Case("train", "--resume with another dtype", ["train", "{target}", "--data", "{data}", "--out", "{out}",
                                                  "--resume", "--dtype", "bfloat16", "--quiet"], start_from="run"),
    Case("train", "--resume from the cache instead of the data", ["train", "{target}", "--cache", "{cache}", "--out",
                                                                  "{out}", "--resume", "--quiet"], start_from="run"),
    Case("train", "token ids past the vocabulary in a shard", ["train", "{target}", "--data", "{baddata}", "--out",
                                                               "{out}", "--config", "{cfg}", "--quiet"]),
    Case("train", "an Inf state in a cache shard that passes its checksum",
         ["train", "{target}", "--cache", "{badcache}", "--out", "{out}", "--config", "{cfg}", "--quiet"]),
    # capture
    Case("capture", "SIGTERM, then the same command", ["capture", "{target}", "--data", "{data}", "--out", "{out}",
                                                       "--dtype", "float32", "--aux-layers", "1,2,3",
                                                       "--max-tokens-per-shard", "300", "--quiet"],
         status=143, signal=signal.SIGTERM),
    Case("capture", "--out a training run", ["capture", "{target}", "--data", "{data}", "--out", "{run}", "--force"]),
    Case("capture", "--out the target", ["capture", "{target}", "--data", "{data}", "--out", "{target}"]),
    Case("capture", "disk full mid-shard", ["capture", "{target}", "--data", "{data}", "--out", "{out}", "--quiet"],
         inject=("outrider.train.states.cache._write_file", "ENOSPC")),
    Case("capture", "a second writer", ["capture", "{target}", "--data", "{data}", "--out", "{out}"], holder="cache"),
    Case("capture", "SIGKILL, then the same command", ["capture", "{target}", "--data", "{data}", "--out", "{out}",
                                                       "--dtype", "float32", "--aux-layers", "1,2,3",
                                                       "--max-tokens-per-shard", "300", "--quiet"],
         status=0, signal=signal.SIGKILL),
    Case("capture", "--max-tokens-per-shard 0", ["capture", "{target}", "--data", "{data}", "--out", "{out}",
                                                 "--max-tokens-per-shard", "0"]),
    Case("capture", "--device cuda without CUDA", ["capture", "{target}", "--data", "{data}", "--out", "{out}",
                                                   "--device", "cuda"]),
    # export
    Case("export", "--out the run it reads", ["export", "{run}/head", "--format", "vllm", "--out", "{run}"]),
    Case("export", "--out a folder of the user's", ["export", "{run}/head", "--format", "vllm", "--out", "{docs}"]),
    Case("export", "--out a regular file", ["export", "{run}/head", "--format", "vllm", "--out", "{file}"]),
    Case("export", "--out a dataset", ["export", "{run}/head", "--format", "vllm", "--out", "{data}"]),
    Case("export", "--out name too long", ["export", "{run}/head", "--format", "vllm", "--out",
                                           "{tmp}/" + "n" * 300]),
    Case("export", "disk full", ["export", "{run}/head", "--format", "vllm", "--out", "{out}"],
         inject=("safetensors.torch.save_file", "ENOSPC"), start_from="export"),
    Case("export", "permission denied", ["export", "{run}/head", "--format", "vllm", "--out", "{out}"],
         inject=("outrider.outputs._lock", "EACCES"), start_from="export"),
    Case("export", "real read-only mount", ["export", "{run}/head", "--format", "vllm", "--out", "{ro}/export"],
         needs_mount=True),
    Case("export", "a second writer", ["export", "{run}/head", "--format", "vllm", "--out", "{out}"],
         holder="export"),
    Case("export", "SIGKILL, then the same command", ["export", "{run}/head", "--format", "sglang", "--out", "{out}"],
         status=0, signal=signal.SIGKILL, start_from="export"),
    Case("export", "--out on /proc", ["export", "{run}/head", "--format", "vllm", "--out", "/proc/outrider-e"]),
    Case("export", "a head with a NaN weight", ["export", "{nanhead}", "--format", "vllm", "--out", "{out}"]),
    Case("export", "a head whose d2t leaves the vocabulary", ["export", "{d2thead}", "--format", "vllm", "--out",
                                                              "{out}"]),
    Case("export", "--num-speculative-tokens -3", ["export", "{run}/head", "--format", "vllm", "--out", "{out}",
                                                   "--num-speculative-tokens", "-3"]),
    # bench and generate
    Case("bench", "--json a folder", ["bench", "{target}", "--prompts", "{prompts}", "--json", "{docs}"]),
    Case("bench", "--json a file of the user's", ["bench", "{target}", "--prompts", "{prompts}", "--json",
                                                  "{docs}/thesis.txt"]),
    Case("bench", "--json unwritable after measuring", ["bench", "{target}", "--method", "ngram", "--k", "3",
                                                        "--max-new-tokens", "8", "--num-prompts", "2", "--prompts",
                                                        "{prompts}", "--json", "{tmp}/b.json", "--quiet"],
         inject=("outrider.bench.local.write_json_output", "EROFS")),
    Case("bench", "--json on a read-only mount", ["bench", "{target}", "--prompts", "{prompts}", "--json",
                                                  "{ro}/b.json"], needs_mount=True),
    Case("bench", "--k 100 --max-new-tokens 8", ["bench", "{target}", "--method", "ngram", "--k", "100",
                                                 "--max-new-tokens", "8"]),
    Case("bench", "--k above --max-new-tokens", ["bench", "{target}", "--method", "ngram", "--k", "8",
                                                 "--max-new-tokens", "4"]),
    Case("bench", "--k 1000000", ["bench", "{target}", "--method", "ngram", "--k", "1000000"]),
    Case("bench", "--prompts a conversation file", ["bench", "{target}", "--method", "ngram", "--prompts", "{convs}",
                                                    "--max-new-tokens", "4"]),
    Case("bench", "eagle3 given a full model", ["bench", "{target}", "--method", "eagle3", "--draft", "{target}"]),
    Case("bench", "draft given an EAGLE-3 head", ["bench", "{target}", "--method", "draft", "--draft", "{run}/head"]),
    Case("bench", "--device cuda without CUDA", ["bench", "{target}", "--device", "cuda"]),
    Case("bench", "--device tpu", ["bench", "{target}", "--device", "tpu"]),
    Case("bench", "--json a named pipe", ["bench", "{target}", "--method", "ngram", "--k", "2", "--max-new-tokens",
                                          "4", "--json", "{fifo}"]),
    Case("bench", "eagle3 with a NaN head", ["bench", "{target}", "--method", "eagle3", "--draft", "{nanhead}",
                                             "--k", "2", "--max-new-tokens", "4", "--num-prompts", "1", "--prompts",
                                             "{prompts}"]),
    Case("bench", "UTF-16 prompts", ["bench", "{target}", "--method", "ngram", "--k", "2", "--max-new-tokens", "4",
                                     "--prompts", "{utf16}"]),
    Case("bench", "--num-prompts 50 of 2, one prompt too long", ["bench", "{target}", "--method", "ngram", "--k", "2",
                                                                 "--max-new-tokens", "4", "--num-prompts", "50",
                                                                 "--prompts", "{longprompts}", "--max-prompt-tokens",
                                                                 "24", "--quiet"],
         status=0, expect="1 of 2 prompts truncated"),
    Case("generate", "--device cuda without CUDA", ["generate", "{target}", "--prompt", "hi", "--device", "cuda"]),
    Case("generate", "--k 0", ["generate", "{target}", "--prompt", "hi", "--method", "ngram", "--k", "0"]),
    Case("generate", "--top-p 0", ["generate", "{target}", "--prompt", "hi", "--top-p", "0"]),
    # plan, inspect, demo
    Case("plan", "--json a bench record", ["plan", "default", "--hardware", "h100", "--json", "{bench}"]),
    Case("plan", "--json a folder", ["plan", "default", "--hardware", "h100", "--json", "{docs}"]),
    Case("plan", "--plot a folder of the user's", ["plan", "default", "--hardware", "h100", "--plot", "{docs}"]),
    Case("plan", "--out under a file", ["plan", "default", "--hardware", "h100", "--train", "--out", "{file}/p.md"]),
    Case("plan", "--json unwritable", ["plan", "default", "--hardware", "h100", "--json", "{tmp}/p.json"],
         inject=("outrider.plan.planner.write_json_output", "EROFS")),
    Case("plan", "--json on /proc", ["plan", "default", "--hardware", "h100", "--json", "/proc/outrider-p.json"]),
    Case("plan", "--train --out on /proc", ["plan", "default", "--hardware", "h100", "--train", "--out",
                                            "/proc/outrider-p.md"]),
    Case("plan", "--json /dev/full (a device)", ["plan", "default", "--hardware", "h100", "--json", "/dev/full"]),
    Case("plan", "a batch whose KV cache does not fit", ["plan", "kimi-k2.5", "--hardware", "h200", "--tp", "8",
                                                         "--batch", "1,4096", "--context", "32768"],
         status=0, expect="batch 4096: does not fit"),
    Case("plan", "--tp 1000", ["plan", "default", "--hardware", "h100", "--tp", "1000"]),
    Case("plan", "--tp not dividing the heads", ["plan", "default", "--hardware", "h100", "--tp", "2"]),
    Case("plan", "--acceptance with tau 21 at 8 tokens", ["plan", "default", "--hardware", "h100", "--acceptance",
                                                          "{badtau}"]),
    Case("plan", "--hardware a JSON list", ["plan", "default", "--hardware", "{listjson}"]),
    Case("inspect", "--json a file of the user's", ["inspect", "{target}", "--json", "{file}"]),
    Case("inspect", "--json a folder", ["inspect", "{target}", "--json", "{docs}"]),
    Case("inspect", "a config that is a JSON list", ["inspect", "{listmodel}"]),
    Case("inspect", "--json on /proc", ["inspect", "{target}", "--json", "/proc/outrider-i.json"]),
    Case("inspect", "a head with a NaN weight", ["inspect", "{target}", "--draft", "{nanhead}"], status=1,
         expect="not servable: finite weights"),
    Case("pull", "HOME empty", ["pull", "--quiet", "--from", "{tmp}"], env={"HOME": "", "OUTRIDER_HOME": ""}),
    Case("demo", "--out a folder of the user's", ["demo", "--out", "{docs}"]),
    Case("demo", "--out an export, --force", ["demo", "--out", "{export}", "--force"]),
    Case("demo", "a second writer", ["demo", "--out", "{out}"], holder="demo"),
]

GUARDED = ("target", "convs", "data", "run", "export", "cache", "bench", "docs", "file", "cfg", "prompts", "data2",
           "nanhead", "d2thead", "baddata", "badcache")


def digest(*paths: Path) -> dict[str, str]:
    out = {}
    for root in paths:
        if not root.exists():
            continue
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and p.name != LOCK)
        out.update({str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
    return out


def cli(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "outrider.cli", *argv], capture_output=True, text=True, check=False,
                          **kw)


def build_world(root: Path) -> dict[str, Path]:
    from damage import cache_with_inf, dataset_with_id, head_with
    from test_trainer import _conversations
    from tiny import save_tiny

    from outrider.config import TrainConfig

    w = {"root": root, "target": save_tiny("llama", root / "tiny"), "tmp": root / "scratch"}
    w["tmp"].mkdir()
    w["convs"] = _conversations(root / "convs.json", 24, 0, 5, 60)
    w["convs2"] = _conversations(root / "convs2.json", 24, 1, 5, 60)
    w["cfg"] = TrainConfig(steps=6, batch_size=2, grad_accum=1, max_length=48, lr=3e-3, warmup_steps=1, ttt_steps=2,
                           draft_vocab_size=40, eval_every=3, save_every=1, eval_examples=4, log_every=1,
                           aux_layer_ids=(1, 2, 3)).save(root / "cfg.json")
    w["prompts"] = root / "prompts.txt"
    w["prompts"].write_text("w5 w6 w7 w5 w6 w7\nw9 w10 w11 w12 w9 w10\n")
    w["bench"] = root / "bench.json"
    for name, argv in [
        ("data", ["data", "{target}", "--dataset", "{convs}", "--out", "{out}", "--eval-fraction", "0.2", "--quiet"]),
        ("data2", ["data", "{target}", "--dataset", "{convs2}", "--out", "{out}", "--eval-fraction", "0.2",
                   "--quiet"]),
        ("run", ["train", "{target}", "--data", "{data}", "--out", "{out}", "--config", "{cfg}", "--quiet"]),
        ("export", ["export", "{run}/head", "--format", "vllm", "--out", "{out}", "--target", "{target}"]),
        ("cache", ["capture", "{target}", "--data", "{data}", "--out", "{out}", "--dtype", "float32", "--aux-layers",
                   "1,2,3", "--max-tokens-per-shard", "300", "--quiet"]),
        ("bench", ["bench", "{target}", "--method", "ngram", "--k", "3", "--max-new-tokens", "8", "--num-prompts",
                   "2", "--prompts", "{prompts}", "--json", "{out}", "--quiet"]),
    ]:
        w.setdefault(name, root / name)
        done = cli([a.format(out=w[name], **w) for a in argv])
        if done.returncode:
            raise SystemExit(f"building the {name} output failed:\n{done.stderr[-3000:]}")
    w["docs"] = root / "mydocs"
    (w["docs"] / "sub").mkdir(parents=True)
    (w["docs"] / "thesis.txt").write_text("chapter 1\n")
    (w["docs"] / "sub" / "notes.txt").write_text("notes\n")
    w["file"] = root / "regular.txt"
    w["file"].write_text("a regular file\n")
    w["listjson"] = root / "list.json"
    w["listjson"].write_text("[1, 2]\n")
    w["listmodel"] = root / "listmodel"
    w["listmodel"].mkdir()
    (w["listmodel"] / "config.json").write_text("[1]\n")
    w["nanhead"] = head_with(w["run"] / "head", root / "nanhead", "nan")
    w["d2thead"] = head_with(w["run"] / "head", root / "d2thead", "d2t")
    w["baddata"] = root / "baddata"
    dataset_with_id(w["data"], w["baddata"])
    w["badcache"] = root / "badcache"
    cache_with_inf(w["cache"], w["badcache"])
    w["fifo"] = root / "pipe"
    os.mkfifo(w["fifo"])
    w["latin"] = root / "latin.json"
    w["latin"].write_bytes('[{"conversations": [{"from": "human", "value": "caf\u00e9"}]}]'.encode("latin-1"))
    w["utf16"] = root / "utf16.txt"
    w["utf16"].write_bytes("w5 w6\nw7\n".encode("utf-16"))
    w["longprompts"] = root / "long.txt"
    w["longprompts"].write_text("w5 w6 w7\n" + " ".join(f"w{5 + i % 40}" for i in range(60)) + "\n")
    w["badtau"] = root / "badtau.json"
    w["badtau"].write_text(json.dumps([{"method": "ngram", "k": 100, "tau": 21.0, "max_new_tokens": 8,
                                        "accept_rate_per_pos": [0.9] * 100}]))
    return w


def mounts(root: Path) -> dict[str, Path] | None:
    """A nearly full tmpfs and a read-only one, where this machine lets us mount them."""
    full, ro = root / "full", root / "ro"
    full.mkdir()
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], capture_output=True,
                      check=False).returncode:
        return None
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)], capture_output=True, check=True)
    st = os.statvfs(full)
    (full / "ballast").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 8192))
    return {"full": full, "ro": ro}


def unmount(m: dict[str, Path] | None) -> None:
    for p in (m or {}).values():
        subprocess.run(["umount", "-l", str(p)], capture_output=True, check=False)


def complete(folder: Path, kind: str) -> bool:
    marker = {"data": "manifest.json", "export": "LAUNCH.md", "run": "head/config.json", "cache": "manifest.json"}
    return (folder / marker[kind]).is_file()


def run_case(case: Case, w: dict[str, Path], scratch: Path, rng: random.Random) -> dict:
    out = scratch / "out"
    if case.start_from:
        shutil.copytree(w[case.start_from], out)
    fmt = dict(w, out=out)
    argv = [a.format(**fmt) for a in case.argv]
    before = digest(*(w[k] for k in GUARDED))
    mine = digest(out)
    holder = None
    if case.holder:
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out), case.holder], stdout=subprocess.PIPE,
                                  text=True)
        holder.stdout.readline()
    cmd = ([sys.executable, "-c", INJECT, *case.inject] if case.inject else
           [sys.executable, "-m", "outrider.cli"]) + argv
    t0 = time.monotonic()
    env = {**os.environ, **case.env} if case.env else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if case.signal is not None:
        wait_for_writer(out, proc)
        time.sleep(rng.uniform(0, 1.5))
        if proc.poll() is None:
            proc.send_signal(case.signal)
    out_text, err = proc.communicate(timeout=600)
    if holder is not None:
        holder.kill()
        holder.wait()
    status, lines = proc.returncode, [x for x in err.splitlines() if x.startswith("outrider ")]
    tracebacks = int("Traceback" in err)
    lost = digest(*(w[k] for k in GUARDED)) != before
    rerun_status = None
    if case.signal == signal.SIGKILL:
        handled = status in (-signal.SIGKILL, 0)
        if case.start_from and digest(out) != mine and not complete(out, case.start_from):
            lost = True
        resume = ["--resume"] if argv[0] == "train" and (out / "last" / "trainer_state.pt").exists() else []
        again = cli(argv + resume, timeout=600)
        rerun_status, tracebacks = again.returncode, tracebacks + int("Traceback" in again.stderr)
        handled = handled and again.returncode == 0
    elif case.signal is not None:  # SIGINT, SIGTERM: one line, its status; train and capture then go on
        handled = status in (case.status, 0) and (status == 0 or len(lines) == 1)
        if case.start_from and digest(out) != mine and not complete(out, case.start_from):
            lost = True
        if argv[0] in ("train", "capture"):
            resume = ["--resume"] if argv[0] == "train" and (out / "last" / "trainer_state.pt").exists() else []
            again = cli(argv + resume, timeout=600)
            rerun_status, tracebacks = again.returncode, tracebacks + int("Traceback" in again.stderr)
            handled = handled and again.returncode == 0
    else:
        handled = status == case.status and (status in (0, 1) or len(lines) == 1)
    noticed = case.expect is None or case.expect in " ".join((out_text + err).split())
    handled = handled and noticed
    silent = (status == 0 and case.status not in (0, 130, 143) and case.signal is None) or not noticed
    if case.start_from and case.signal is None and digest(out) != mine:
        lost = True  # a refused or failed verb left its earlier output changed
    return {"verb": case.verb, "fault": case.fault, "status": status, "rerun_status": rerun_status,
            "handled": bool(handled and not tracebacks), "traceback": bool(tracebacks), "data_lost": bool(lost),
            "one_line_exit_2": status == 2 and len(lines) == 1 and not tracebacks, "silent_wrong": bool(silent),
            "line": lines[-1] if lines else (err.strip().splitlines() or [""])[-1][:300],
            "seconds": round(time.monotonic() - t0, 1)}


def table(results: list[dict]) -> tuple[str, list[dict]]:
    rows = []
    for verb in dict.fromkeys(r["verb"] for r in results):
        mine = [r for r in results if r["verb"] == verb]
        rows.append({"verb": verb, "faults_tried": len(mine), "handled": sum(r["handled"] for r in mine),
                     "one_line_exit_2": sum(r["one_line_exit_2"] for r in mine),
                     "tracebacks": sum(r["traceback"] for r in mine), "silent_wrong": sum(r["silent_wrong"] for r in mine),
                     "data_lost": sum(r["data_lost"] for r in mine)})
    keys = ("faults_tried", "handled", "one_line_exit_2", "tracebacks", "silent_wrong", "data_lost")
    rows.append({"verb": "all", **{k: sum(r[k] for r in rows) for k in keys}})
    lines = ["| verb | faults tried | handled | one line, exit 2 | tracebacks | silent wrong | data lost |",
             "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(str(r[k]) for k in ("verb",) + keys) + " |" for r in rows]
    return "\n".join(lines), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, metavar="FILE", help="write the table and every case as JSON")
    ap.add_argument("--only", default=None, help="comma-separated verbs to run")
    ap.add_argument("--seed", type=int, default=0, help="seeds the random signal times")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    cases = [c for c in CASES if a.only is None or c.verb in a.only.split(",")]
    with tempfile.TemporaryDirectory(prefix="outrider-faults-") as tmp:
        root = Path(tmp)
        w = build_world(root / "world")
        m = mounts(root)
        results = []
        try:
            for i, case in enumerate(cases):
                if case.needs_mount and m is None:
                    continue
                scratch = root / f"case{i}"
                scratch.mkdir()
                r = run_case(case, {**w, **(m or {}), "tmp": scratch}, scratch, rng)
                results.append(r)
                print(f"[{i + 1}/{len(cases)}] {r['verb']}: {r['fault']}: status {r['status']}"
                      + ("" if r["handled"] else "  NOT HANDLED") + (" TRACEBACK" if r["traceback"] else "")
                      + (" DATA LOST" if r["data_lost"] else ""), file=sys.stderr, flush=True)
        finally:
            unmount(m)
    text, rows = table(results)
    print(text)
    bad = [r for r in results if not r["handled"] or r["traceback"] or r["data_lost"]]
    if bad:
        print("\nnot handled:\n" + "\n".join(f"- {r['verb']}: {r['fault']} (status {r['status']}): {r['line']}"
                                             for r in bad))
    print(f"\n`python benchmarks/faults.py --seed {a.seed}` on {os.cpu_count()} CPU cores, "
          f"{'with' if m else 'without'} real tmpfs mounts")
    if a.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                                check=False).stdout.strip()
        Path(a.json).write_text(json.dumps({
            "command": f"python benchmarks/faults.py --seed {a.seed}", "seed": a.seed, "mounts": m is not None,
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"), "commit": commit,
            "cpu_cores": os.cpu_count(), "table": rows, "cases": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
