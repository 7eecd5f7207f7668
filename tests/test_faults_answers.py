"""Trust every answer (issue 35): outputs on any path, values inside inputs, resume only the run that
was, signals, files and homes, words that fit. Each case asserts the exit status and the single
line (no traceback), and that nothing written before was lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from damage import cache_with_inf, dataset_with_id, head_with
from test_faults import CLI, _digest, _one_line
from test_trainer import _conversations
from tiny import save_tiny

from outrider.cli import main as cli_main
from outrider.config import TrainConfig
from outrider.outputs import LOCK

CFG = TrainConfig(steps=10, batch_size=2, grad_accum=1, max_length=48, lr=3e-3, warmup_steps=1, ttt_steps=2,
                  draft_vocab_size=40, eval_every=5, save_every=5, eval_examples=4, log_every=1,
                  aux_layer_ids=(1, 2, 3))


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """A tiny target, two token datasets, a cache and one uninterrupted training run."""
    root = tmp_path_factory.mktemp("answers")
    w = {"root": root, "target": save_tiny("llama", root / "tiny")}
    w["convs"] = _conversations(root / "convs.json", 24, 0, 5, 60)
    w["convs2"] = _conversations(root / "convs2.json", 24, 1, 5, 60)
    w["cfg"] = CFG.save(root / "cfg.json")
    for name, convs in (("data", "convs"), ("data2", "convs2")):
        w[name] = root / name
        assert cli_main(["data", str(w["target"]), "--dataset", str(w[convs]), "--out", str(w[name]),
                         "--eval-fraction", "0.2", "--quiet"]) == 0
    w["run"] = root / "run"
    assert cli_main(["train", str(w["target"]), "--data", str(w["data"]), "--out", str(w["run"]), "--config",
                     str(w["cfg"]), "--quiet", "--device", "cpu"]) == 0
    return w


def _train(w, out: Path, *extra: str, data: str = "data") -> list[str]:
    return ["train", str(w["target"]), "--data", str(w[data]), "--out", str(out), "--config", str(w["cfg"]),
            "--quiet", "--device", "cpu", *extra]


def _head(run: Path) -> str:
    return list(_digest(run / "last" / "head" / "model.safetensors").values())[0]


# ---------------------------------------------------------------------------------------------
# 1. Outputs on any path: one writer helper, one line naming the path


@pytest.fixture()
def fifo(tmp_path):
    p = tmp_path / "pipe"
    os.mkfifo(p)
    return p


@pytest.mark.parametrize("argv", [
    ["plan", "default", "--hardware", "h100", "--json", "{proc}/p.json"],
    ["plan", "default", "--hardware", "h100", "--train", "--out", "{proc}/p.md"],
    ["inspect", "{target}", "--json", "{proc}/i.json"],
    ["export", "{run}/head", "--format", "vllm", "--out", "{proc}/e"],
    ["data", "{target}", "--dataset", "{convs}", "--out", "{proc}/d", "--quiet"],
    ["train", "{target}", "--data", "{data}", "--out", "{proc}/r", "--quiet"],
    ["capture", "{target}", "--data", "{data}", "--out", "{proc}/c", "--quiet"],
    ["plan", "default", "--hardware", "h100", "--json", "{fifo}"],
    ["inspect", "{target}", "--json", "{fifo}"],
    ["bench", "{target}", "--method", "ngram", "--k", "2", "--max-new-tokens", "4", "--json", "{fifo}"],
], ids=lambda a: f"{a[0]}-{'fifo' if '{fifo}' in a else 'proc'}-{a[-1 if a[-1] != '--quiet' else -2].split('/')[-1]}")
def test_an_output_the_system_refuses_is_one_line_naming_it(w, fifo, capsys, argv):
    argv = [a.format(proc="/proc", fifo=fifo, **w) for a in argv]
    before = _digest(w["run"], w["data"])
    assert cli_main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    named = next(a for a in argv if a.startswith("/proc") or a == str(fifo))
    assert named in line, line
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # a pipe is never replaced by a file
    assert _digest(w["run"], w["data"]) == before


def test_fsutil_names_the_output_for_an_error_in_its_temporary(tmp_path, monkeypatch):
    from outrider.errors import UserError
    from outrider.fsutil import OutputError, atomic_write_json

    def refuse(*_a, **_k):
        raise OSError(22, "Invalid argument")  # what a file system answers for a name it refuses

    monkeypatch.setattr("outrider.fsutil.tempfile.mkstemp", refuse)
    with pytest.raises(UserError, match=r"cannot write .*x\.json: Invalid argument") as e:
        atomic_write_json(tmp_path / "x.json", {})
    assert isinstance(e.value, OutputError) and isinstance(e.value, OSError) and e.value.errno == 22
    assert not (tmp_path / "x.json").exists()


# ---------------------------------------------------------------------------------------------
# 6. Files and homes


def test_everything_written_honours_the_umask(w, tmp_path):
    old = os.umask(0o027)
    try:
        assert cli_main(["export", str(w["run"] / "head"), "--format", "vllm", "--out", str(tmp_path / "e")]) == 0
        assert cli_main(_train(w, tmp_path / "r", "--max-steps", "1")) == 0
    finally:
        os.umask(old)
    modes = {str(p): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*") if p.name != LOCK}
    assert modes and all(m == (0o750 if Path(p).is_dir() else 0o640) for p, m in modes.items()), modes
    assert stat.S_IMODE((w["run"] / "head" / "model.safetensors").stat().st_mode) & 0o044  # readable by others


@pytest.mark.parametrize("home", ["", "unwritable"])
def test_an_empty_or_unwritable_home_names_outrider_home(tmp_path, home):
    env = {k: v for k, v in os.environ.items() if k != "OUTRIDER_HOME"}
    if home:
        if os.geteuid() == 0:
            pytest.skip("root may write anywhere")
        (tmp_path / "h").mkdir(mode=0o555)
        home = str(tmp_path / "h")
    env["HOME"] = home
    done = subprocess.run(CLI + ["pull", "--quiet", "--from", str(tmp_path)], capture_output=True, text=True,
                          env=env, check=False, timeout=120)
    assert done.returncode == 2
    assert "OUTRIDER_HOME" in _one_line(done.stderr)
    assert not Path("/.cache/outrider").exists() or home


# ---------------------------------------------------------------------------------------------
# 8. Words that fit


@pytest.mark.parametrize("verb, data, guess", [
    ("data", '[{"conversations": [{"from": "human", "value": "caf\u00e9"}]}]'.encode("latin-1"), "Latin-1"),
    ("bench", "w5 w6\nw7\n".encode("utf-16"), "UTF-16"),
])
def test_a_file_in_another_encoding_is_not_utf8_with_a_guess(w, tmp_path, capsys, verb, data, guess):
    path = tmp_path / ("in.json" if verb == "data" else "prompts.txt")
    path.write_bytes(data)
    argv = (["data", str(w["target"]), "--dataset", str(path), "--out", str(tmp_path / "o"), "--quiet"]
            if verb == "data" else ["bench", str(w["target"]), "--method", "ngram", "--k", "2",
                                    "--max-new-tokens", "4", "--prompts", str(path)])
    assert cli_main(argv) == 2
    line = _one_line(capsys.readouterr().err, contains="is not UTF-8")
    assert guess in line and "not a text file" not in line


# ---------------------------------------------------------------------------------------------
# 5. Signals


def _signal_after_first_step(argv: list[str], out: Path, sig: int, ready) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(CLI + argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not ready(out):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(argv, proc.returncode, "", err)


def _trained_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum('"type": "train"' in line for line in path.read_text().splitlines())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_train_checkpoints_at_the_step_and_resumes_bit_exact(w, tmp_path, sig):
    out = tmp_path / "run"
    done = _signal_after_first_step(_train(w, out), out, sig, lambda o: _trained_steps(o) >= 2)
    assert done.returncode == 128 + sig, done.stderr[-2000:]
    line = _one_line(done.stderr, contains=f"interrupted by {signal.Signals(sig).name}")
    state = json.loads((out / "last" / "trainer_state.json").read_text())
    assert 2 <= state["step"] < CFG.steps and f"step {state['step']}" in line  # the step it stopped at
    assert "--resume" in line
    resumed = subprocess.run(CLI + _train(w, out, "--resume"), capture_output=True, text=True, check=False)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed {out} at step {state['step']} of {CFG.steps}" in resumed.stderr
    assert _head(out) == _head(w["run"])  # bit-exact against the uninterrupted run


def test_sigterm_during_capture_keeps_finished_shards_and_the_rerun_matches(w, tmp_path):
    out = tmp_path / "cache"
    argv = ["capture", str(w["target"]), "--data", str(w["data"]), "--out", str(out), "--dtype", "float32",
            "--aux-layers", "1,2,3", "--max-tokens-per-shard", "200", "--quiet", "--device", "cpu"]
    done = _signal_after_first_step(argv, out, signal.SIGTERM, lambda o: any(o.glob("shard-*")))
    if done.returncode == 0:
        pytest.skip("the capture finished before the signal")
    assert done.returncode == 143
    _one_line(done.stderr, contains="interrupted by SIGTERM")
    kept = _digest(*sorted(out.glob("shard-*")))
    assert kept
    assert cli_main(argv) == 0
    ref = tmp_path / "ref"
    assert cli_main(argv[:5] + [str(ref)] + argv[6:]) == 0
    assert {Path(k).name: v for k, v in kept.items()}.items() <= \
        {Path(k).name: v for k, v in _digest(*sorted(out.glob("shard-*"))).items()}.items()
    assert list(_digest(*sorted(out.glob("shard-*"))).values()) == list(_digest(*sorted(ref.glob("shard-*"))).values())


# ---------------------------------------------------------------------------------------------
# 3. Resume only the run that was


@pytest.fixture(scope="module")
def stopped(w):
    """A run stopped at step 5 (its checkpoint holds the run's identity)."""
    out = w["root"] / "stopped"
    assert cli_main(_train(w, out, "--max-steps", "5")) == 0
    return out


@pytest.mark.parametrize("change, extra, data, name", [
    ("the data's content", [], "data2", "data"),
    ("the dtype", ["--dtype", "bfloat16"], "data", "dtype"),
    ("the source", ["--stream-layers"], "data", "source"),
])
def test_resume_refuses_a_changed_run_naming_what_changed(w, stopped, tmp_path, capsys, change, extra, data, name):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    before = _digest(run)
    assert cli_main(_train(w, run, "--resume", *extra, data=data)) == 2, change
    line = _one_line(capsys.readouterr().err, contains=f"--allow-change {name}")
    assert "changed since the checkpoint" in line
    assert _digest(run) == before


def test_resume_with_an_allowed_change_is_logged(w, stopped, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    assert cli_main(_train(w, run, "--allow-change", "data")) == 2  # it means nothing without --resume
    _one_line(capsys.readouterr().err, contains="give it with --resume")
    assert cli_main(_train(w, run, "--resume", "--allow-change", "data", "--max-steps", "6", data="data2")) == 0
    assert "changed on purpose (--allow-change): data" in capsys.readouterr().err
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r["type"] == "resume"]
    assert len(logged) == 1 and logged[0]["step"] == 5 and set(logged[0]["changed"]) == {"data"}
    state = json.loads((run / "last" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["identity"]["data"] == logged[0]["changed"]["data"][1]


def test_resume_of_the_same_run_says_what_was_resumed(w, stopped, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    assert cli_main(_train(w, run, "--resume")) == 0
    err = capsys.readouterr().err
    assert f"resumed {run} at step 5 of {CFG.steps}: data " in err and "dtype float32" in err
    assert _head(run) == _head(w["run"])


# ---------------------------------------------------------------------------------------------
# 2. Values inside inputs


@pytest.mark.parametrize("how, tensor", [("nan", "fc.weight"), ("d2t", "d2t")])
def test_a_damaged_head_is_not_servable_and_bench_and_export_refuse_it(w, tmp_path, capsys, how, tensor):
    head = head_with(w["run"] / "head", tmp_path / f"head-{how}", how)
    report = tmp_path / "inspect.json"
    assert cli_main(["inspect", str(w["target"]), "--draft", str(head), "--json", str(report)]) == 1
    checks = json.loads(report.read_text())
    assert checks["servable"] is False
    assert any(c["status"] == "fail" and c["name"] == ("finite weights" if how == "nan" else "d2t")
               for c in checks["checks"])
    capsys.readouterr()
    for argv in (["bench", str(w["target"]), "--method", "eagle3", "--draft", str(head), "--k", "2",
                  "--max-new-tokens", "4", "--num-prompts", "1"],
                 ["export", str(head), "--format", "sglang", "--out", str(tmp_path / "e")]):
        assert cli_main(argv) == 2, argv[0]
        line = _one_line(capsys.readouterr().err, contains=f"tensor {tensor}")
        assert "model.safetensors" in line and "reload" not in line  # the head is blamed, not the export
    assert not (tmp_path / "e").exists()


def test_token_ids_outside_the_vocabulary_in_a_dataset_are_refused_naming_the_shard(w, tmp_path, capsys):
    data = tmp_path / "data"
    shard = dataset_with_id(w["data"], data)
    argv = _train(w, tmp_path / "r")
    argv[argv.index("--data") + 1] = str(data)
    assert cli_main(argv) == 2
    line = _one_line(capsys.readouterr().err, contains="input_ids")
    assert shard.name in line and "outside the vocabulary" in line and "1000000" in line
    assert not (tmp_path / "r").exists()


def test_nan_states_in_a_cache_shard_that_passes_its_checksum_are_refused(w, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert cli_main(["capture", str(w["target"]), "--data", str(w["data"]), "--out", str(tmp_path / "good"), "--dtype",
                     "float32", "--aux-layers", "1,2,3", "--quiet", "--device", "cpu"]) == 0
    shard = cache_with_inf(tmp_path / "good", cache)
    assert cli_main(["train", str(w["target"]), "--cache", str(cache), "--out", str(tmp_path / "r"), "--config",
                     str(w["cfg"]), "--quiet", "--device", "cpu"]) == 2
    line = _one_line(capsys.readouterr().err, contains="tensor aux")
    assert shard.name in line and "non-finite" in line


# ---------------------------------------------------------------------------------------------
# 4. Nothing shortened in silence


def test_fit_prompt_keeps_the_template_start_and_end_and_says_it_cut(w):
    from outrider.bench.local import fit_prompt
    from outrider.models import load_tokenizer

    tok = load_tokenizer(w["target"])

    def whole(text: str) -> list[int]:  # the prompt in the template, never cut
        return fit_prompt(tok, text, 10 ** 9)[0]

    short, long = "w5 w6", " ".join(f"w{5 + i % 40}" for i in range(60))
    bare, full = whole(""), whole(short)
    prefix = next(i for i, (a, b) in enumerate(zip(bare, full)) if a != b)
    suffix = len(bare) - prefix
    ids, cut = fit_prompt(tok, long, 20)
    assert cut and len(ids) <= 20 and ids[:prefix] == bare[:prefix] and ids[-suffix:] == bare[-suffix:]
    body = ids[prefix:-suffix]
    assert body and body == whole(long)[-suffix - len(body):-suffix]  # the end of the text
    assert fit_prompt(tok, short, 20) == (full, False)


def test_bench_counts_truncated_prompts_and_fewer_prompts_than_asked(w, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7 w5 w6 w7\n" + " ".join(f"w{5 + i % 40}" for i in range(60)) + "\n")
    out = tmp_path / "b.json"
    assert cli_main(["bench", str(w["target"]), "--method", "ngram", "--k", "2", "--max-new-tokens", "4",
                     "--num-prompts", "5", "--prompts", str(prompts), "--max-prompt-tokens", "24", "--json",
                     str(out), "--quiet"]) == 0
    shown = capsys.readouterr().out
    record = json.loads(out.read_text())[0]
    assert (record["num_prompts"], record["num_prompts_asked"], record["truncated_prompts"]) == (2, 5, 1)
    assert record["max_prompt_tokens"] == 24
    assert "--num-prompts 5, but" in shown and "ran 2" in shown
    assert "1 of 2 prompts truncated to 24 tokens" in " ".join(shown.split())
    assert cli_main(["bench", str(w["target"]), "--method", "ngram", "--k", "2", "--max-new-tokens", "4",
                     "--prompts", str(prompts), "--max-prompt-tokens", "2"]) == 2
    _one_line(capsys.readouterr().err, contains="shorter than the chat template alone")


def test_bench_skips_a_prompt_the_cut_makes_the_same_as_an_earlier_one(w, tmp_path, capsys):
    tail = " ".join(f"w{5 + i % 40}" for i in range(60))  # two texts that differ only before the kept tail
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"w9 {tail}\nw7 {tail}\nw5 w6 w7\n")
    out = tmp_path / "b.json"
    assert cli_main(["bench", str(w["target"]), "--method", "ngram", "--k", "2", "--max-new-tokens", "4",
                     "--num-prompts", "2", "--prompts", str(prompts), "--max-prompt-tokens", "24", "--json",
                     str(out), "--quiet"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    record = json.loads(out.read_text())[0]
    assert (record["num_prompts"], record["truncated_prompts"], record["repeated_prompts"]) == (2, 1, 1)
    assert "1 prompt(s) came out the same tokens as an earlier one" in shown  # the notice before the run
    assert "ngram: 1 prompt(s) skipped, the same tokens as an earlier one" in shown  # and under the table

    from outrider.bench.local import prepare_prompts
    from outrider.models import load_tokenizer

    tok = load_tokenizer(w["target"])
    ran = prepare_prompts(tok, str(prompts), 2, 24).ids
    whole = prepare_prompts(tok, str(prompts), 3, 10 ** 6).ids  # uncut: all three differ
    assert ran[0] == prepare_prompts(tok, str(prompts), 1, 24).ids[0] and ran[1] == whole[2]
    short = prepare_prompts(tok, str(prompts), 3, 24)  # the file has no third distinct prompt
    assert (len(short.ids), short.repeated) == (2, 1)
    assert "holds 2 distinct: ran 2" in short.notices(str(prompts))[0]


def test_turns_a_server_refuses_are_counted_told_and_asked_again(tmp_path, capsys):
    from test_openai_client import REJECT_WORD, TinyServer, conversations
    from tiny import make_tiny, tiny_tokenizer

    from outrider.train.data.datasets import read_manifest

    target = str(save_tiny("llama", tmp_path / "target", seed=0))
    records = conversations(6)
    turns = [t for t in records[2]["conversations"] if t["from"] == "human"]  # k = 2: three turns
    turns[1]["value"] = f"w11 {REJECT_WORD}"  # the second turn is refused: the conversation is cut short
    src = tmp_path / "convs.json"
    src.write_text(json.dumps(records))
    argv = ["data", target, "--dataset", str(src), "--out", str(tmp_path / "d"), "--regenerate", "--max-new-tokens",
            "4", "--eval-fraction", "0", "--quiet"]
    with TinyServer(make_tiny("llama", 0), tiny_tokenizer()) as srv:
        assert cli_main(argv + ["--server", srv.url]) == 0
        first = len(srv.chat_requests)
        out = " ".join(capsys.readouterr().out.split())
        regen = read_manifest(tmp_path / "d")["regenerate"]
        assert regen["truncated_by_server"] == 1 and regen["server_refusal"].startswith("HTTP 400")
        assert "prompt too long" in out and "1 conversation(s) cut short" in out
        assert cli_main(argv + ["--server", srv.url]) == 0  # the refused one is asked again, the rest cached
        assert len(srv.chat_requests) - first == 1  # its first turn, answered again; the others from the cache
        assert cli_main(argv + ["--server", srv.url, "--server-model", "other"]) == 2
    _one_line(capsys.readouterr().err, contains="fix --server-model")


# ---------------------------------------------------------------------------------------------
# 7. Plans that cannot run


@pytest.mark.parametrize("target, argv, kv_token", [
    ("kimi-k2.5", ["--hardware", "h200", "--tp", "8", "--context", "32768"], (512 + 64) * 61 * 2),  # MLA latent
    ("default", ["--hardware", "h100", "--context", "8192"], 2 * 3 * 64 * 30 * 2),  # GQA: 3 KV heads of 64
])
def test_plan_rows_that_do_not_fit_memory_say_so_and_are_not_recommended(tmp_path, capsys, target, argv, kv_token):
    out = tmp_path / "plan.json"
    assert cli_main(["plan", target, *argv, "--batch", "1,100000", "--k", "2,3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    small, huge = [r for r in rows if r["batch"] == 1], [r for r in rows if r["batch"] == 100000]
    assert small and huge and all(r["fits_memory"] for r in small) and not any(r["fits_memory"] for r in huge)
    tokens = int(argv[argv.index("--context") + 1]) + 128
    assert huge[0]["memory_gb_per_gpu"] - small[0]["memory_gb_per_gpu"] == pytest.approx(
        (100000 - 1) * tokens * kv_token / 1e9, rel=1e-3)
    assert small[0]["memory_gb_per_gpu"] > 0  # the weights
    text = " ".join(capsys.readouterr().out.split())
    assert "batch 100000: does not fit" in text and f"{kv_token / 1e3:,.1f} kB/token/GPU" in text
    assert "does not fit" not in text.split("Recommendation")[1].split("batch 100000")[0]  # batch 1 is recommended
