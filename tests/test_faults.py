"""Fault injection on every verb's outputs: outputs of another kind or foreign files refused, one
writer per output, full and read-only file systems, SIGKILL at random points, Ctrl-C, numbers and
inputs of the wrong kind. Each case asserts the exit status, the single line (no traceback), and
that every earlier output is byte-identical afterwards (the lock file, which holds its last
holder's pid, excepted)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_trainer import _conversations
from tiny import save_tiny

from outrider.cli import main as cli_main
from outrider.config import TrainConfig
from outrider.outputs import LOCK, MARKER, claim_dir, wait_for_writer

CFG = TrainConfig(steps=6, batch_size=2, grad_accum=1, max_length=48, lr=3e-3, warmup_steps=1, ttt_steps=2,
                  draft_vocab_size=40, eval_every=3, save_every=1, eval_examples=4, log_every=1,
                  aux_layer_ids=(1, 2, 3))
CLI = [sys.executable, "-m", "outrider.cli"]


def _digest(*paths: Path) -> dict[str, str]:
    """sha256 of every file under the paths (the lock file excepted: it names its last holder)."""
    out = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and p.name != LOCK)
        out.update({str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
    return out


def _one_line(err: str, *, contains: str = "") -> str:
    """The single `outrider VERB: ...` line of stderr (progress bars of the model loader aside)."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("outrider ")]
    assert len(lines) == 1, err[-3000:]
    assert contains in lines[0], lines[0]
    return lines[0]


def _temps(*folders: Path) -> list[Path]:
    """Temporaries (``.NAME.XXXXXXXX.tmp``/``.old``) inside or next to the folders."""
    found = []
    for f in folders:
        found += [p for p in f.parent.iterdir() if p.name.startswith(f".{f.name}.") and p.suffix in (".tmp", ".old")]
        if f.is_dir():
            found += [p for p in f.rglob(".*") if p.suffix in (".tmp", ".old")]
    return found


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target and one earlier output of every kind, all written through the CLI."""
    root = tmp_path_factory.mktemp("faults")
    w = {"root": root, "target": save_tiny("llama", root / "tiny")}
    w["convs"] = _conversations(root / "convs.json", 24, 0, 5, 60)
    w["cfg"] = CFG.save(root / "cfg.json")
    w["prompts"] = root / "prompts.txt"
    w["prompts"].write_text("w5 w6 w7 w5 w6 w7\nw9 w10 w11 w12 w9 w10\n")
    for name, argv in [
        ("data", ["data", "{target}", "--dataset", "{convs}", "--out", "{out}", "--eval-fraction", "0.2", "--quiet"]),
        ("run", ["train", "{target}", "--data", "{data}", "--out", "{out}", "--config", "{cfg}", "--quiet",
                 "--device", "cpu"]),
        ("export", ["export", "{run}/head", "--format", "vllm", "--out", "{out}", "--target", "{target}"]),
        ("cache", ["capture", "{target}", "--data", "{data}", "--out", "{out}", "--dtype", "float32", "--aux-layers",
                   "1,2,3", "--max-tokens-per-shard", "300", "--quiet", "--device", "cpu"]),
        ("bench", ["bench", "{target}", "--method", "ngram", "--k", "3", "--max-new-tokens", "8",
                        "--num-prompts", "2", "--prompts", "{prompts}", "--json", "{out}", "--quiet"]),
    ]:
        w[name] = root / (name + ".json" if name == "bench" else name)
        assert cli_main([a.format(out=w[name], **w) for a in argv]) == 0, name
    w["docs"] = root / "mydocs"  # a folder of the user's: never touched
    (w["docs"] / "sub").mkdir(parents=True)
    (w["docs"] / "thesis.txt").write_text("chapter 1\n")
    (w["docs"] / "sub" / "notes.txt").write_text("notes\n")
    w["file"] = root / "regular.txt"
    w["file"].write_text("a regular file\n")
    return w


def _earlier(w) -> dict[str, str]:
    return _digest(*(w[k] for k in ("target", "convs", "data", "run", "export", "cache", "bench", "docs",
                                    "file", "cfg", "prompts")))


def _copy(w, name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(w[name], dst)
    return dst


# ---------------------------------------------------------------------------------------------
# Part 1: outputs never destroy


REFUSED = [  # argv (formatted with the world), a fragment of the one line
    (["export", "{run}/head", "--format", "vllm", "--out", "{run}"], "holds the input"),
    (["export", "{run}/head", "--format", "vllm", "--out", "{docs}"], "did not write"),
    (["export", "{run}/head", "--format", "vllm", "--out", "{file}"], "is a file, not a folder"),
    (["export", "{run}/head", "--format", "vllm", "--out", "{data}"], "holds a token dataset"),
    (["data", "{target}", "--dataset", "{data}/../convs.json", "--out", "{root}", "--quiet"], "holds the input"),
    (["data", "{target}", "--dataset", "{convs}", "--out", "{docs}", "--quiet"], "did not write"),
    (["data", "{target}", "--dataset", "{convs}", "--out", "{run}", "--quiet"], "holds a training run"),
    (["data", "{target}", "--dataset", "{convs}", "--out", "{file}/sub", "--quiet"], "which is a file"),
    (["train", "{target}", "--data", "{data}", "--out", "{data}", "--quiet"], "is the input"),
    (["train", "{target}", "--data", "{data}", "--out", "{export}", "--force", "--quiet"], "holds an exported head"),
    (["train", "{target}", "--data", "{data}", "--out", "{docs}", "--force", "--quiet"], "did not write"),
    (["train", "{target}", "--data", "{data}", "--out", "{run}", "--quiet", "--config", "{cfg}"],
     "already holds a training run"),
    (["capture", "{target}", "--data", "{data}", "--out", "{run}", "--force", "--quiet"], "holds a training run"),
    (["capture", "{target}", "--data", "{data}", "--out", "{target}", "--quiet"], "is the input"),
    (["demo", "--out", "{docs}"], "did not write"),
    (["demo", "--out", "{export}", "--force"], "holds an exported head"),
    (["plan", "default", "--hardware", "h100", "--plot", "{docs}"], "did not write"),
    (["plan", "default", "--hardware", "h100", "--json", "{bench}"], "not an earlier"),
    (["plan", "default", "--hardware", "h100", "--train", "--out", "{docs}/thesis.txt"], "not an earlier"),
    (["bench", "{target}", "--prompts", "{prompts}", "--json", "{docs}"], "is a folder"),
    (["bench", "{target}", "--prompts", "{prompts}", "--json", "{prompts}"], "not an earlier"),
    (["inspect", "{target}", "--json", "{file}"], "not an earlier"),
]


@pytest.mark.parametrize("argv, message", REFUSED, ids=[f"{a[0]}-{i}" for i, (a, _) in enumerate(REFUSED)])
def test_outputs_of_another_kind_or_holding_other_files_are_refused(world, capsys, argv, message):
    before = _earlier(world)
    assert cli_main([a.format(**world) for a in argv]) == 2
    _one_line(capsys.readouterr().err, contains=message)
    assert _earlier(world) == before


def test_own_outputs_are_replaced_resumed_or_forced(world, tmp_path, capsys):
    before = _earlier(world)
    export, data, cache, run = (_copy(world, n, tmp_path) for n in ("export", "data", "cache", "run"))
    lock_inode = (export / LOCK).stat().st_ino
    head = str(world["run"] / "head")
    assert cli_main(["export", head, "--format", "sglang", "--out", str(export)]) == 0  # its own kind: replaced
    assert json.loads((export / MARKER).read_text())["kind"] == "export"
    assert (export / LOCK).stat().st_ino == lock_inode  # carried through the swap: the lock stayed held
    assert cli_main(["data", str(world["target"]), "--dataset", str(world["convs"]), "--out", str(data),
                     "--eval-fraction", "0.2", "--quiet"]) == 0
    assert json.loads((data / "manifest.json").read_text())["format"] == "outrider-tokens"
    assert (data / MARKER).is_file() and not _temps(data)
    assert cli_main(["capture", str(world["target"]), "--data", str(world["data"]), "--out", str(cache), "--dtype", "float32",
                     "--aux-layers", "1,2,3", "--max-tokens-per-shard", "300", "--quiet"]) == 0  # resumed: done
    assert "already finished" in capsys.readouterr().out
    assert cli_main(["train", str(world["target"]), "--data", str(data), "--out", str(run), "--config",
                     str(world["cfg"]), "--quiet", "--force", "--max-steps", "2"]) == 0
    assert json.loads((run / "last" / "trainer_state.json").read_text())["step"] == 2  # replaced, not resumed
    assert _earlier(world) == before


def test_leftover_temporaries_of_a_killed_run_are_cleaned_by_the_next(world, tmp_path):
    export = _copy(world, "export", tmp_path)
    run = _copy(world, "run", tmp_path)
    stale = [tmp_path / ".export.abcd1234.tmp", export / ".config.json.k2j4h5g6.tmp", run / ".last.zzzz9999.tmp",
             run / "last" / ".trainer_state.pt.q1w2e3r4.tmp"]
    stale[0].mkdir()
    (stale[0] / "model.safetensors").write_bytes(b"half")
    stale[2].mkdir()
    for p in (stale[1], stale[3]):
        p.write_bytes(b"half")
    assert cli_main(["export", str(world["run"] / "head"), "--format", "vllm", "--out", str(export)]) == 0
    assert not _temps(export)
    with claim_dir(run, "run"):  # what any later `train --out run` does first
        pass
    assert not _temps(run) and not any(p.exists() for p in stale)


def test_fsutil_keeps_live_temporaries(tmp_path):
    from outrider.fsutil import atomic_dir, atomic_path, remove_stale_temps

    with atomic_path(tmp_path / "f.json") as tmp, atomic_dir(tmp_path / "d") as tmpdir:
        tmp.write_text("{}")
        assert remove_stale_temps(tmp_path / "f.json") == [] and remove_stale_temps(tmp_path / "d") == []
        assert tmp.exists() and tmpdir.exists()
    assert (tmp_path / "f.json").read_text() == "{}" and (tmp_path / "d").is_dir()


# ---------------------------------------------------------------------------------------------
# Part 2: one writer per output


@pytest.mark.parametrize("verb", ["data", "export", "capture", "train", "demo"])
def test_a_second_writer_is_refused_at_once_naming_the_holder(world, tmp_path, capsys, verb):
    kind = {"data": "dataset", "export": "export", "capture": "cache", "train": "run", "demo": "demo"}[verb]
    out = tmp_path / "out"
    code = ("import sys, time; from outrider.outputs import claim_dir\n"
            f"with claim_dir(sys.argv[1], {kind!r}):\n print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = {"data": ["data", "{target}", "--dataset", "{convs}", "--quiet"],
                "export": ["export", "{run}/head", "--format", "vllm"],
                "capture": ["capture", "{target}", "--data", "{data}", "--quiet"],
                "train": ["train", "{target}", "--data", "{data}", "--quiet"],
                "demo": ["demo"]}[verb]
        t0 = time.monotonic()
        assert cli_main([a.format(**world) for a in argv] + ["--out", str(out)]) == 2
        assert time.monotonic() - t0 < 30  # at once: no waiting for the holder
        _one_line(capsys.readouterr().err, contains=f"another outrider process (pid {holder.pid})")
    finally:
        holder.kill()  # SIGKILL: the OS releases the lock
        holder.wait()
    with claim_dir(out, kind):
        pass


def test_two_concurrent_trainings_one_refused_the_other_intact(world, tmp_path, capsys):
    out = tmp_path / "run"
    first = subprocess.Popen(CLI + ["train", str(world["target"]), "--data", str(world["data"]), "--out", str(out),
                                    "--config", str(world["cfg"]), "--quiet", "--device", "cpu"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / LOCK).exists() or not (out / LOCK).read_text().strip():
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()[1][-2000:]
        time.sleep(0.05)
    assert first.poll() is None  # still training: the second writer comes now (in this process)
    assert cli_main(["train", str(world["target"]), "--data", str(world["data"]), "--out", str(out), "--config",
                     str(world["cfg"]), "--quiet"]) == 2
    _one_line(capsys.readouterr().err, contains=f"pid {first.pid}")
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["type"] == "train"]
    assert steps == list(range(1, CFG.steps + 1))  # one run's lines, each once
    ref = _digest(world["run"] / "head" / "model.safetensors")
    assert list(_digest(out / "head" / "model.safetensors").values()) == list(ref.values())


# ---------------------------------------------------------------------------------------------
# Part 3: every OS error is a user error


def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _torch_save_on_a_full_disk(*_args, **_kwargs):
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None


def _erofs(path: str):
    def fail(*_args, **_kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    return fail


FULL = [  # (what to break, argv, its earlier output in the world, a fragment of the line)
    ("outrider.train.data.datasets._write_split", _enospc,
     ["data", "{target}", "--dataset", "{convs}", "--out", "{out}", "--quiet"], "data", "no space left"),
    ("safetensors.torch.save_file", _enospc,
     ["export", "{run}/head", "--format", "vllm", "--out", "{out}"], "export", "no space left"),
    ("outrider.train.loop.checkpoint.torch.save", _torch_save_on_a_full_disk,
     ["train", "{target}", "--data", "{data}", "--out", "{out}", "--config", "{cfg}", "--quiet", "--force"], "run",
     "no space left"),
    ("outrider.train.states.cache._write_file", _enospc,
     ["capture", "{target}", "--data", "{data}", "--out", "{out}", "--dtype", "bf16", "--aux-layers", "1,2,3",
      "--quiet", "--force"], "cache", "the disk is full"),
    ("outrider.outputs._lock", "erofs", ["export", "{run}/head", "--format", "vllm", "--out", "{out}"], "export",
     "read-only"),
    ("outrider.plan.planner.write_json_output", "erofs", ["plan", "default", "--hardware", "h100", "--json", "{out}"],
     None, "read-only"),
]


@pytest.mark.parametrize("where, fault, argv, earlier, message", FULL, ids=[f[2][0] + "-" + f[4] for f in FULL])
def test_full_or_read_only_file_system_is_one_line_and_keeps_what_was_there(world, tmp_path, monkeypatch, capsys,
                                                                             where, fault, argv, earlier, message):
    out = _copy(world, earlier, tmp_path) if earlier else tmp_path / "out.json"
    before, mine = _earlier(world), _digest(out) if out.exists() else {}
    module, _, name = where.rpartition(".")
    monkeypatch.setattr(f"{module}.{name}", _erofs(str(out)) if fault == "erofs" else fault)
    assert cli_main([a.format(out=out, **world) for a in argv]) == 2
    line = _one_line(capsys.readouterr().err, contains=message)
    assert "outrider" in line and str(out.name) in line or message == "the disk is full"
    assert _earlier(world) == before
    if argv[0] not in ("train", "capture"):  # --force replaced those on purpose before the disk filled
        assert (_digest(out) if out.exists() else {}) == mine
    assert not _temps(out)


def test_bench_prints_then_saves_the_measurement_elsewhere_when_its_json_cannot_be_written(world, tmp_path,
                                                                                           monkeypatch, capsys):
    out = tmp_path / "b.json"
    monkeypatch.setattr("outrider.records.write_json_output", _erofs(str(out)))
    assert cli_main(["bench", str(world["target"]), "--method", "ngram", "--k", "3", "--max-new-tokens", "8",
                     "--num-prompts", "2", "--prompts", str(world["prompts"]), "--json", str(out), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert "outrider bench" in captured.out and "ngram" in captured.out  # the table came first
    line = _one_line(captured.err, contains="read-only")
    fallback = Path(line.split("saved to ")[1].strip())
    record = json.loads(fallback.read_text())[0]
    assert record["method"] == "ngram" and record["num_prompts"] == 2 and not out.exists()
    fallback.unlink()


@pytest.fixture()
def small_fs(tmp_path):
    """A real 4 MiB tmpfs and a read-only view of it (skipped where the test may not mount them)."""
    mnt, view = tmp_path / "mnt", tmp_path / "ro"
    mnt.mkdir()
    view.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True,
                      check=False).returncode:
        pytest.skip("cannot mount a tmpfs here (the monkeypatched cases above cover the same errors)")
    try:
        subprocess.run(["mount", "--bind", str(mnt), str(view)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True, capture_output=True)
        yield mnt, view
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False, capture_output=True)
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


def test_real_full_and_read_only_file_systems(world, small_fs, capsys):
    small_fs, view = small_fs
    shutil.copytree(world["export"], small_fs / "export")
    before, mine = _earlier(world), _digest(small_fs / "export")
    # full: the dataset's shards do not fit in what is left (a page or two)
    st = os.statvfs(small_fs)
    (small_fs / "ballast").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 8192))
    assert cli_main(["data", str(world["target"]), "--dataset", str(world["convs"]), "--out",
                     str(small_fs / "data"), "--quiet"]) == 2
    _one_line(capsys.readouterr().err, contains="no space left")
    assert not (small_fs / "data").exists() and not _temps(small_fs / "data")
    for argv, message in [
        (["export", str(world["run"] / "head"), "--format", "vllm", "--out", str(view / "export")], "read-only"),
        (["export", str(world["run"] / "head"), "--format", "vllm", "--out", str(view / "new")], "read-only"),
        (["data", str(world["target"]), "--dataset", str(world["convs"]), "--out", str(view / "d"), "--quiet"],
         "read-only"),
        (["bench", str(world["target"]), "--prompts", str(world["prompts"]), "--json", str(view / "b.json")],
         "read-only"),
        (["plan", "default", "--hardware", "h100", "--json", str(view / "p.json")], "read-only"),
    ]:
        assert cli_main(argv) == 2
        _one_line(capsys.readouterr().err, contains=message)
    assert _digest(small_fs / "export") == mine and _earlier(world) == before


# ---------------------------------------------------------------------------------------------
# SIGKILL at random points, and Ctrl-C


def _start_and_signal(argv: list[str], out: Path, sig: int, rng: random.Random, max_delay: float):
    """Start the verb, wait until it holds its output's lock (or a moment for file outputs), then
    send ``sig`` after a random delay; return the finished process and its stderr."""
    proc = subprocess.Popen(CLI + argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_writer(out, proc)
    time.sleep(rng.uniform(0, max_delay))
    if proc.poll() is None:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    return proc, err


KILLED = [  # verb, argv, the earlier output it starts from (None: a new folder), random delay bound (s)
    ("train", ["train", "{target}", "--data", "{data}", "--out", "{out}", "--config", "{cfg}", "--quiet"], None, 4.0),
    ("data --regenerate", ["data", "{target}", "--dataset", "{convs}", "--out", "{out}", "--regenerate",
                           "--max-new-tokens", "4", "--max-conversations", "8", "--eval-fraction", "0.2",
                           "--quiet"], "data", 3.0),
    ("export", ["export", "{run}/head", "--format", "sglang", "--out", "{out}"], "export", 1.0),
    ("capture", ["capture", "{target}", "--data", "{data}", "--out", "{out}", "--dtype", "float32", "--aux-layers",
                 "1,2,3", "--max-tokens-per-shard", "300", "--quiet"], None, 2.0),
]


@pytest.mark.parametrize("verb, argv, earlier, max_delay", KILLED, ids=[k[0] for k in KILLED])
def test_sigkill_at_a_random_point_loses_nothing_and_the_rerun_finishes(world, tmp_path, verb, argv, earlier,
                                                                        max_delay):
    rng = random.Random(f"{verb}-{os.environ.get('OUTRIDER_FAULT_SEED', '0')}")
    out = _copy(world, earlier, tmp_path) if earlier else tmp_path / "out"
    before, mine = _earlier(world), _digest(out) if out.exists() else {}
    args = [a.format(out=out, **world) for a in argv]
    proc, err = _start_and_signal(args, out, signal.SIGKILL, rng, max_delay)
    assert proc.returncode in (-signal.SIGKILL, 0), err[-2000:]
    assert _earlier(world) == before
    if earlier and _digest(out) != mine:  # the kill came after the swap: the new output is whole
        assert (out / ("manifest.json" if earlier == "data" else "LAUNCH.md")).is_file()
    resume = ["--resume"] if verb == "train" and (out / "last" / "trainer_state.pt").exists() else []
    assert cli_main(args + resume) == 0
    assert not _temps(out) and (out / MARKER).is_file()
    if verb == "train":  # resumed exactly: the uninterrupted run's head
        assert list(_digest(out / "last" / "head" / "model.safetensors").values()) \
            == list(_digest(world["run"] / "last" / "head" / "model.safetensors").values())
    if verb == "capture":
        shards = sorted(out.glob("shard-*"))
        assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in shards] == \
            [hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(world["cache"].glob("shard-*"))]


def test_ctrl_c_is_one_line_status_130_and_the_run_resumes(world, tmp_path):
    out = tmp_path / "run"
    args = [a.format(out=out, **world) for a in KILLED[0][1]]
    proc, err = _start_and_signal(args, out, signal.SIGINT, random.Random(1), 3.0)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal")
    assert proc.returncode == 130
    _one_line(err, contains="interrupted")
    resume = ["--resume"] if (out / "last" / "trainer_state.pt").exists() else []
    assert cli_main(args + resume) == 0
    assert list(_digest(out / "last" / "head" / "model.safetensors").values()) \
        == list(_digest(world["run"] / "last" / "head" / "model.safetensors").values())


# ---------------------------------------------------------------------------------------------
# Part 4: numbers checked before work starts; inputs of the wrong kind


BAD = [
    (["bench", "{target}", "--method", "ngram", "--k", "100", "--max-new-tokens", "8"], "--k: must be an integer in 1..64"),
    (["bench", "{target}", "--method", "ngram", "--k", "8", "--max-new-tokens", "4"], "exceeds --max-new-tokens"),
    (["bench", "{target}", "--num-prompts", "0"], "--num-prompts: must be an integer >= 1"),
    (["bench", "{target}", "--batch-size", "-1"], "--batch-size"),
    (["bench", "{target}", "--temperature", "nan"], "--temperature"),
    (["bench", "{target}", "--method", "ngram", "--prompts", "{convs}", "--max-new-tokens", "4"],
     "is a conversation file"),
    (["bench", "{target}", "--method", "eagle3", "--draft", "{target}"], "is a full model, not an EAGLE-3 head"),
    (["bench", "{target}", "--method", "draft", "--draft", "{run}/head"], "is an EAGLE-3 head, not a draft model"),
    (["generate", "{target}", "--prompt", "hi", "--top-p", "0"], "--top-p"),
    (["generate", "{target}", "--prompt", "hi", "--top-k", "-1"], "--top-k"),
    (["generate", "{target}", "--prompt", "hi", "--device", "tpu"], "unknown device 'tpu'"),
    (["data", "{target}", "--out", "{out}", "--eval-fraction", "1"], "--eval-fraction"),
    (["data", "{target}", "--out", "{out}", "--max-length", "4"], "--max-length"),
    (["data", "{target}", "--out", "{out}", "--concurrency", "0"], "--concurrency"),
    (["train", "{target}", "--data", "{data}", "--out", "{out}", "--max-steps", "0"], "--max-steps"),
    (["train", "{target}", "--data", "{data}", "--out", "{out}", "--aux-layers", "1,-2,3"], "--aux-layers"),
    (["train", "{target}", "--data", "{data}", "--out", "{out}", "--config", "{out}.json"], "JSON object"),
    (["train", "{target}", "--data", "{data}", "--out", "{out}", "--resume", "--force"], "give only one"),
    (["capture", "{target}", "--data", "{data}", "--out", "{out}", "--max-tokens-per-shard", "0"],
     "--max-tokens-per-shard"),
    (["export", "{run}/head", "--format", "vllm", "--out", "{out}", "--num-speculative-tokens", "-3"],
     "--num-speculative-tokens"),
    (["plan", "default", "--hardware", "h100", "--tp", "1000"], "--tp"),
    (["plan", "default", "--hardware", "h100", "--tp", "2"], "cannot shard"),
    (["plan", "default", "--hardware", "h100", "--k", "0,3"], "--k"),
    (["plan", "default", "--hardware", "h100", "--tau", "9", "--tau-k", "3"], "impossible"),
    (["plan", "default", "--hardware", "h100", "--alpha", "2"], "--alpha"),
    (["plan", "default", "--hardware", "h100", "--acceptance", "{out}.json"], "impossible"),
    (["plan", "default", "--hardware", "h100", "--train", "--gpus", "0"], "--gpus"),
    (["plan", "default", "--hardware", "h100", "--train", "--epochs", "0"], "--epochs"),
    (["plan", "default", "--hardware", "h100", "--decode-tps", "1:-5"], "--decode-tps"),
]
if not torch.cuda.is_available():
    BAD += [([verb, "{target}", *rest, "--device", "cuda"], "CUDA is not available")
            for verb, rest in [("generate", ["--prompt", "hi"]), ("bench", []),
                               ("train", ["--data", "{data}", "--out", "{out}"]),
                               ("capture", ["--data", "{data}", "--out", "{out}"])]]


@pytest.mark.parametrize("argv, message", BAD, ids=[f"{a[0]}-{i}" for i, (a, _) in enumerate(BAD)])
def test_numbers_and_inputs_of_the_wrong_kind_are_refused_before_work(world, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    (tmp_path / "out.json").write_text(json.dumps([{"method": "ngram", "k": 100, "tau": 21.0, "max_new_tokens": 8,
                                                     "accept_rate_per_pos": [0.9] * 100}])
                                       if argv[0] == "plan" else json.dumps([{"steps": 3}]))
    before = _earlier(world)
    t0 = time.monotonic()
    assert cli_main([a.format(out=out, **world) for a in argv]) == 2
    _one_line(capsys.readouterr().err, contains=message)
    assert time.monotonic() - t0 < 30 and not out.exists()  # refused before any work or output
    assert _earlier(world) == before


def test_bench_tau_obeys_its_definition_and_plan_takes_the_record(world, tmp_path, capsys):
    path = tmp_path / "b.json"
    assert cli_main(["bench", str(world["target"]), "--method", "ngram", "--k", "8", "--max-new-tokens", "8",
                     "--num-prompts", "2", "--prompts", str(world["prompts"]), "--json", str(path), "--quiet"]) == 0
    r = json.loads(path.read_text())[0]
    emitted = r["new_tokens"] - r["num_prompts"]  # the prefill yields each prompt's first token
    assert 1.0 <= r["tau"] <= min(r["k"] + 1, r["max_new_tokens"] - 1)
    assert sum(t * n for t, n in zip(r["tau_per_batch"], r["row_steps_per_batch"])) == pytest.approx(emitted)
    assert cli_main(["plan", "default", "--hardware", "h100", "--acceptance", str(path), "--k", "3"]) == 0
