"""Data-parallel capture on CPU (gloo, 2 and 3 processes): the cache of N ranks is the cache of one
process, byte for byte in float32 (online and layer-streamed, Llama and DeepSeek-V3); a killed rank
resumes with another N; a failing rank stops the others with one line; bad input is one line, exit 2."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_trainer import _conversations
from tiny import save_tiny

from outrider.config import TrainConfig
from outrider.errors import UserError
from outrider.outputs import claim_dir
from outrider.train.data.prepare import build_dataset
from outrider.train.loop.trainer import train
from outrider.train.options import TrainOptions
from outrider.train.states.capture_ranks import assign, rank_placement

SHARD = "200"  # tokens per shard: 8 shards of the 30 examples below
CAPTURE = ["--dtype", "float32", "--aux-layers", "1,2,3", "--max-tokens-per-shard", SHARD, "--device", "cpu",
           "--quiet"]
STREAM = ["--stream-layers", "--tokens-per-pass", "120"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture-dist")
    w = {"root": root}
    convs = _conversations(root / "a.json", 30, 0, 5, 60)
    for kind in ("llama", "deepseek_v3"):
        w[kind] = save_tiny(kind, root / kind)
        build_dataset(str(w[kind]), str(convs), str(root / f"data-{kind}"), eval_fraction=0.2, progress=False)
        w[f"data-{kind}"] = root / f"data-{kind}"
    build_dataset(str(w["llama"]), str(_conversations(root / "b.json", 2, 1, 5, 60)), str(root / "two"),
                  eval_fraction=0.0, progress=False)
    w["data-two"] = root / "two"
    return w


def _argv(w, kind: str, out: Path, *extra: str) -> list[str]:
    return ["capture", str(w[kind]), "--data", str(w[f"data-{kind}"]), "--out", str(out), *CAPTURE, *extra]


def _one(w, kind: str, streamed: bool) -> Path:
    """The single-process cache (captured once per module), one thread like each torchrun rank: a CPU
    kernel may round differently with another number of threads."""
    out = w["root"] / f"one-{kind}-{'streamed' if streamed else 'online'}"
    if not (out / "manifest.json").exists():
        argv = [sys.executable, "-m", "outrider", *_argv(w, kind, out, *(STREAM if streamed else ()))]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=_env())
        assert res.returncode == 0, res.stderr[-3000:]
    return out


def _files(cache: Path) -> dict[str, str]:
    """sha256 of the header, the manifest and every shard."""
    names = ["header.json", "manifest.json"] + sorted(p.name for p in cache.glob("shard-*"))
    return {n: hashlib.sha256((cache / n).read_bytes()).hexdigest() for n in names}


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _torchrun(n: int, argv: list[str], code: str | None = None, logs: Path | None = None
              ) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node n -m outrider ARGV`` (``code``: that Python script instead of ``-m outrider``;
    ``logs``: each rank's stdout and stderr to its own file there, ``_rank_logs``)."""
    head = ["-m", "outrider"]
    if code is not None:
        script = Path(str(logs or argv[-1]) + ".py")
        script.write_text(code)
        head = [str(script)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           *(["--redirects", "3", "--log-dir", str(logs)] if logs else []), *head, *argv]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    if res.returncode != 0 and "exitcode  : -6" in res.stderr and logs is None:
        # About one gloo run in 20 had a rank abort in the process group's teardown after every rank
        # passed the closing barrier (the cache complete); none in 60 runs since ranks leave through
        # exit_process. Should it come back, run once more: the rerun resumes the complete cache, and
        # the test checks its bytes as before.
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    return res


def _rank_logs(logs: Path, n: int) -> list[str]:
    """Each rank's stderr under torchrun's ``--log-dir`` (``<run>/attempt_0/<rank>/stderr.log``)."""
    return [next(logs.rglob(f"attempt_0/{r}/stderr.log")).read_text() for r in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(argvs: list[list[str]], code: str | None = None) -> list[subprocess.Popen]:
    """Start one process per argv as the ranks of one group (what torchrun sets), each with its own
    stderr; ``code`` (Python, run with the argv) instead of ``-m outrider``."""
    port, n = _free_port(), len(argvs)
    procs = []
    for r, argv in enumerate(argvs):
        env = dict(_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        head = ["-c", code] if code else ["-m", "outrider"]
        procs.append(subprocess.Popen([sys.executable, *head, *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    return [(p.wait(timeout=300), p.stderr.read()) for p in procs]


def _one_line(errs: list[str], contains: str, res: subprocess.CompletedProcess | None = None) -> str:
    """All ranks together print one `outrider capture` line and no traceback; under torchrun (``res``) the
    run fails with rank 0's status 2, else every rank's status (``errs`` from ``_finish``) is 2."""
    if res is None:
        assert [rc for rc, _ in errs] == [2] * len(errs), errs
        errs = [e for _, e in errs]
    else:
        assert res.returncode != 0 and "exitcode  : 2" in res.stderr, res.stderr[-3000:]
    err = "".join(errs)
    assert "Traceback" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("outrider capture")]
    assert len(lines) == 1 and contains in lines[0], err[-3000:]
    return lines[0]


# ---------------------------------------------------------------------------------------------


def test_assign_balances_tokens_deterministically():
    tokens = {0: 200, 1: 190, 2: 200, 3: 50, 4: 200, 5: 10}
    deal = assign(tokens, 2)  # 0, 2, 4, 1, 3, 5 each to the lighter rank: loads 410 and 440
    assert deal == [[0, 4, 5], [1, 2, 3]] and deal == assign(dict(reversed(tokens.items())), 2)
    assert sorted(k for d in deal for k in d) == sorted(tokens)
    loads = [sum(tokens[k] for k in d) for d in deal]
    assert max(loads) - min(loads) <= max(tokens.values())  # by tokens, not by count
    assert assign({7: 5}, 3) == [[7], [], []] and assign({}, 2) == [[], []]


def test_rank_placement_gives_each_rank_its_own_gpus():
    free = {0: 80, 1: 80, 2: 80, 3: 80, "cpu": 1000}
    assert rank_placement("auto", 1, 2, 4, free) == ("auto", {2: 80, 3: 80, "cpu": 500})
    assert rank_placement({"model": 0, "lm_head": "cuda:1", "x": "disk"}, 1, 2, 4) == \
        ({"model": 2, "lm_head": "cuda:3", "x": "disk"}, None)
    assert rank_placement({"": "cpu"}, 1, 2, 0) == ({"": "cpu"}, None) and rank_placement(None, 0, 2, 4) == (None, None)
    with pytest.raises(UserError, match="owns 2 GPU"):
        rank_placement({"model": 2}, 0, 2, 4)
    with pytest.raises(UserError, match="at least one GPU of its own"):
        rank_placement("auto", 0, 3, 2)


# the CPU and the disk through accelerate: every other layer, the final norm and the lm_head offloaded
OFFLOAD = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.layers.2": "disk",
           "model.layers.3": "cpu", "model.norm": "disk", "model.rotary_emb": "cpu", "lm_head": "disk"}


@pytest.mark.parametrize("kind, n, how", [("llama", 2, "online"), ("deepseek_v3", 3, "online"),
                                          ("llama", 3, "streamed"), ("deepseek_v3", 2, "streamed"),
                                          ("llama", 2, "device-map")])
def test_n_ranks_write_the_single_process_cache(world, tmp_path, kind, n, how):
    out = tmp_path / "cache"
    streamed = how == "streamed"
    extra = {"online": [], "streamed": STREAM, "device-map": ["--device-map", json.dumps(OFFLOAD), "--offload-folder",
                                                                str(tmp_path / "offload")]}[how]
    res = _torchrun(n, _argv(world, kind, out, *extra))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("wrote ") == 1 and f"by {n} ranks" in res.stdout  # rank 0 alone reports
    one = _one(world, kind, streamed)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) == 8
    assert _files(out) == _files(one)  # the same examples in the same order, the same float32 bits
    if how == "device-map":  # each rank offloaded its own copy
        assert sorted(p.name for p in (tmp_path / "offload").iterdir()) == ["rank-0", "rank-1"]


KILLABLE = """import os, sys, time
from outrider.train.states import cache
write = cache._write_file
def slow(path, data):
    write(path, data)
    time.sleep(0.4)
cache._write_file = slow
from outrider.cli import entry
entry(sys.argv[1:])
"""


def test_killed_rank_resumes_with_another_n_and_trains_as_one_process(world, tmp_path):
    out = tmp_path / "cache"
    argv = _argv(world, "llama", out)
    procs = _ranks([argv, argv], KILLABLE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and procs[1].poll() is None and len(list(out.glob("shard-*"))) < 2:
        time.sleep(0.005)
    procs[1].send_signal(signal.SIGKILL)
    (rc0, err0), (rc1, _) = _finish(procs)
    assert rc1 == -signal.SIGKILL
    assert rc0 == 2 and "lost contact with another rank" in err0 and "Traceback" not in err0, err0[-3000:]
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("shard-*")}
    assert 2 <= len(finished) < 8 and not json.loads((out / "manifest.json").read_text())["complete"]
    res = _torchrun(3, argv)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"({len(finished)} already finished)" in res.stdout
    for name, stamp in finished.items():  # never rewritten
        assert ((out / name).stat().st_ino, (out / name).stat().st_mtime_ns) == stamp
    one = _one(world, "llama", False)
    assert _files(out) == _files(one)
    cfg = TrainConfig(steps=3, batch_size=2, grad_accum=1, max_length=48, lr=3e-3, warmup_steps=1, ttt_steps=2,
                      draft_vocab_size=40, eval_every=3, save_every=3, eval_examples=4, log_every=1)
    runs = {}
    for name, cache in (("one", one), ("n", out)):
        train(TrainOptions(str(world["llama"]), None, str(tmp_path / f"run-{name}"), config=cfg, progress=False,
                           cache=str(cache)))
        lines = (tmp_path / f"run-{name}" / "metrics.jsonl").read_text().splitlines()
        runs[name] = [r["loss"] for r in map(json.loads, lines) if r["type"] == "train"]
    assert len(runs["one"]) == 3 and np.array_equal(runs["one"], runs["n"])


FAILING = """import errno, os, sys
from outrider.train.states import cache
write = cache._write_file
def full(path, data):
    if os.environ["RANK"] == "1" and int(path.name.split(".")[1].split("-")[1]) >= 2:
        raise OSError(errno.ENOSPC, "No space left on device")
    write(path, data)
cache._write_file = full
from outrider.cli import entry
entry(sys.argv[1:])
"""


def test_a_failing_rank_stops_the_others_with_one_line_naming_it(world, tmp_path):
    out = tmp_path / "cache"
    argv = _argv(world, "llama", out)
    res = _torchrun(2, argv, FAILING, tmp_path / "logs")
    line = _one_line(_rank_logs(tmp_path / "logs", 2), "rank 1 of 2 failed: cannot write shard-", res)
    assert "the disk is full" in line and line.count(" kept") == 1
    kept = json.loads((out / "manifest.json").read_text())["shards"]
    assert kept and all(hashlib.sha256((out / e["file"]).read_bytes()).hexdigest() == e["sha256"] for e in kept)
    res = subprocess.run([sys.executable, "-m", "outrider", *argv], capture_output=True, text=True, timeout=300,
                         env=_env())  # one process finishes it
    assert res.returncode == 0 and _files(out) == _files(_one(world, "llama", False)), res.stderr[-3000:]


def test_more_ranks_than_examples_is_one_line(world, tmp_path):
    out = tmp_path / "cache"
    argv = ["capture", str(world["llama"]), "--data", str(world["data-two"]), "--out", str(out), *CAPTURE]
    res = _torchrun(3, argv, logs=tmp_path / "logs")
    _one_line(_rank_logs(tmp_path / "logs", 3), "3 ranks for 2 examples", res)
    assert not out.exists()  # nothing written, not even the folder


def test_ranks_started_with_different_commands_are_refused(world, tmp_path):
    other = ["--dtype", "bf16", "--aux-layers", "0,2,3"]
    out = tmp_path / "cache"
    argv = _argv(world, "llama", out)
    code = ("import os, sys\nfrom outrider.cli import entry\n"
            f"entry(sys.argv[1:] + ({other!r} if os.environ['RANK'] == '1' else []))\n")
    res = _torchrun(2, argv, code, tmp_path / "logs")
    line = _one_line(_rank_logs(tmp_path / "logs", 2), "rank 1 of 2 was started with another command", res)
    assert "(aux_layer_ids, dtype differ)" in line and not out.exists()


def test_an_existing_cache_of_other_settings_and_a_second_run_are_refused(world, tmp_path):
    one = _one(world, "llama", False)
    before = _files(one)
    res = _torchrun(2, _argv(world, "llama", one, "--dtype", "bf16"), logs=tmp_path / "a")
    _one_line(_rank_logs(tmp_path / "a", 2), "holds a capture with other settings (dtype differ)", res)
    assert _files(one) == before
    with claim_dir(one, "cache"):  # another outrider process writes this cache
        res = _torchrun(2, _argv(world, "llama", one), logs=tmp_path / "b")
        _one_line(_rank_logs(tmp_path / "b", 2), "is being written by another outrider process", res)
    assert _files(one) == before
