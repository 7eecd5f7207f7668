"""`outrider report` from a real (tiny) training run, bench records and plans; wrong inputs; the
page rendered by headless Chromium; `train --report-to tensorboard` read back by TensorBoard."""

from __future__ import annotations

import base64
import html
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import save_tiny

from outrider.bench.local import bench
from outrider.cli import main as cli_main
from outrider.config import TrainConfig
from outrider.errors import UserError
from outrider.report import page
from outrider.train.data.prepare import build_dataset
from outrider.train.loop import logs
from outrider.train.loop.trainer import train
from outrider.train.options import TrainOptions

SERVED = Path(__file__).parents[1] / "benchmarks" / "results" / "served" / "transformers-serve-cpu-4x32.json"
CFG = TrainConfig(steps=8, batch_size=2, grad_accum=1, max_length=48, lr=3e-3, warmup_steps=2, ttt_steps=3,
                  draft_vocab_size=40, eval_every=4, save_every=8, eval_examples=6, log_every=1,
                  aux_layer_ids=(1, 2, 3))


def _conversations(path: Path, n: int = 30, seed: int = 0) -> Path:
    """ShareGPT records over the tiny vocabulary; replies are arithmetic runs a head can learn."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        turns = []
        for _ in range(2):
            turns.append({"from": "human", "value": " ".join(f"w{rng.randrange(5, 90)}" for _ in range(5))})
            start, step = rng.randrange(50), rng.choice([1, 2])
            turns.append({"from": "gpt", "value": " ".join(f"w{5 + (start + step * k) % 50}"
                                                          for k in range(rng.randrange(6, 14)))})
        records.append({"id": f"c{i}", "conversations": turns})
    path.write_text(json.dumps(records))
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A training run (TensorBoard on, stopped and resumed), bench records of its head and of n-gram,
    a plan and a training plan from them: every input kind, through the real code paths."""
    root = tmp_path_factory.mktemp("report")
    target = str(save_tiny("llama", root / "tiny"))
    build_dataset(target, str(_conversations(root / "conv.json")), str(root / "data"), eval_fraction=0.2,
                  progress=False)
    for resume in (False, True):  # stopped at step 5, resumed to the end: two event files
        train(TrainOptions(target, str(root / "data"), str(root / "run"), config=CFG, progress=False,
                           report_to="tensorboard", max_steps=None if resume else 5, resume=resume))
    (root / "prompts.txt").write_text("w5 w6 w7 w8\nw10 w12 w14\n")
    common = dict(num_prompts=2, max_new_tokens=12, prompts=str(root / "prompts.txt"))
    records = [bench(target, "eagle3", draft=str(root / "run" / "head"), k=k, **common) for k in (2, 3)]
    records.append(bench(target, "ngram", k=3, **common))
    (root / "bench.json").write_text(json.dumps(records))
    assert cli_main(["plan", "default", "--hardware", "h200", "--batch", "1,4", "--k", "1,2,3",
                     "--acceptance", str(root / "bench.json"), "--json", str(root / "plan.json")]) == 0
    assert cli_main(["plan", "default", "--hardware", "h200", "--train", "--json", str(root / "tplan.json")]) == 0
    return root


def _sections(text: str) -> dict[str, str]:
    return dict(re.findall(r'<section id="([a-z-]+)">(.*?)</section>', text, flags=re.S))


def _svgs(section: str) -> list[bytes]:
    return [base64.b64decode(d) for d in re.findall(r'src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)"', section)]


def test_page_holds_every_section_the_inputs_allow(made, tmp_path):
    out = tmp_path / "report.html"
    paths = [made / "run", made / "bench.json", made / "plan.json", made / "tplan.json", SERVED]  # SERVED: a
    # real `bench --server` record against `transformers serve`, per concurrency
    assert cli_main(["report", *map(str, paths), "--out", str(out)]) == 0
    text = out.read_text()
    sections = _sections(text)
    assert list(sections) == list(page.SECTIONS)  # every section, in order
    for key in ("training", "acceptance", "speed", "served", "breakdown", "train-plan"):
        figures = _svgs(sections[key])
        assert figures and all(f.lstrip().startswith(b"<?xml") and b"<svg" in f for f in figures), key
    assert len(_svgs(sections["training"])) == 2  # against steps, against training time
    assert len(_svgs(sections["breakdown"])) == 2  # measured, predicted
    # the numbers shown are the records' own, each row citing its source with device, date and commit
    records = json.loads((made / "bench.json").read_text())
    speed = html.unescape(sections["speed"])
    for r in records:  # one source for the file: [1] is the run, [2] the bench records
        assert f"{r['tau']:.3f}" in speed and f"{r['speedup_vs_ar']:.3f}" in speed
        assert f"[2] cpu · {r['date']} · {r['git_commit'] or 'commit not recorded'}" in speed
    plan = json.loads((made / "plan.json").read_text())
    best = max((r for r in plan if r["batch"] == 4 and r["method"] == "eagle3"), key=lambda r: r["speedup"])
    assert f"{best['speedup']:.3f}" in speed and "1 x h200 (predicted)" in speed
    accept = html.unescape(sections["acceptance"])
    assert " ".join(f"{a:.3f}" for a in records[0]["accept_rate_per_pos"]) in accept
    rows = [json.loads(x) for x in (made / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["type"] == "eval"]
    best_eval = max(evals, key=lambda r: r["sim_tau_k"])
    training = html.unescape(sections["training"])
    assert f"{best_eval['sim_tau_k']:.3f}" in training and f"{evals[-1]['walk_tau_k']:.3f}" in training
    tplan = json.loads((made / "tplan.json").read_text())
    assert all(s["stage"] in sections["train-plan"] for s in tplan["stages"])
    assert f"{tplan['tau']['central']:.2f}" in sections["train-plan"]
    assert sections["sources"].count("<tr>") == 1 + 5  # the header, then one row per file
    for r in json.loads(SERVED.read_text()):
        assert f"<td>{r['tokens_per_s']:,.1f}</td>" in sections["served"]
    assert "no acceptance counters" in sections["served"]
    # self-contained: nothing to fetch, no script
    assert not re.search(r'(src|href)="(?!data:|#)', text) and "<script" not in text


def test_a_demo_folder_gives_its_run_and_bench_sections(made, tmp_path):
    demo = tmp_path / "demo"
    shutil.copytree(made / "run", demo / "train")
    shutil.copy(made / "bench.json", demo / "bench.json")
    (demo / "summary.md").write_text("# outrider demo (quick)\n")
    out = demo / "report.html"
    assert cli_main(["report", str(demo), "--out", str(out)]) == 0
    assert list(_sections(out.read_text())) == ["training", "acceptance", "speed", "breakdown", "sources"]
    assert cli_main(["report", str(demo), "--out", str(out)]) == 0  # an earlier report is replaced


def test_records_without_a_k_or_with_gaps_are_tabled_not_charted(made, tmp_path):
    tree = dict(json.loads((made / "bench.json").read_text())[0])  # a tree record names no k
    del tree["k"]
    tree.update(topk=2, steps=3, draft_tokens=6, verify_step_ms=None,
                verdict="equal up to 1 near-ties (largest margin 0.03)")
    (tmp_path / "tree.json").write_text(json.dumps([tree]))
    out = tmp_path / "r.html"
    page.write_report([str(tmp_path / "tree.json")], out)
    sections = _sections(out.read_text())
    assert list(sections) == ["acceptance", "speed", "sources"]  # no k: no chart against k, no breakdown
    assert f"{tree['tau']:.3f}" in sections["speed"] and tree["verdict"] in sections["speed"]


def _one_line_error(capsys, argv: list[str], needle: str) -> None:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err


def test_wrong_inputs_are_one_line_and_exit_2(made, tmp_path, capsys):
    out = str(tmp_path / "r.html")
    (tmp_path / "empty").mkdir()
    _one_line_error(capsys, ["report", str(tmp_path / "empty"), "--out", out], "is an empty folder")
    _one_line_error(capsys, ["report", str(tmp_path / "absent"), "--out", out], "does not exist")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    _one_line_error(capsys, ["report", str(tmp_path / "other"), "--out", out], "holds no training run")
    (tmp_path / "x.json").write_text('{"hello": 1}')
    _one_line_error(capsys, ["report", str(tmp_path / "x.json"), "--out", out], "none of what report reads")
    (tmp_path / "bad.json").write_text('[{"method": "eagle3", "tau"')
    _one_line_error(capsys, ["report", str(tmp_path / "bad.json"), "--out", out], "not valid JSON")
    lines = (made / "run" / "metrics.jsonl").read_text().splitlines()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "metrics.jsonl").write_text("\n".join(lines[:2] + [lines[2][:40]] + lines[3:]) + "\n")
    _one_line_error(capsys, ["report", str(damaged), "--out", out], "line 3 is not a metrics record")
    (damaged / "metrics.jsonl").write_text("")
    _one_line_error(capsys, ["report", str(damaged), "--out", out], "holds no training step yet")
    assert not Path(out).exists()  # nothing written on a refusal
    keep = tmp_path / "keep.html"
    keep.write_text("<html>mine</html>")
    _one_line_error(capsys, ["report", str(made / "bench.json"), "--out", str(keep)], "not an earlier")
    assert keep.read_text() == "<html>mine</html>"


def test_a_cut_last_line_is_skipped_with_a_note(made, tmp_path, capsys):
    lines = (made / "run" / "metrics.jsonl").read_text().splitlines()
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:30])  # killed mid-write
    out = tmp_path / "r.html"
    assert cli_main(["report", str(killed), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"last line (line {len(lines)}) is cut short" in err
    text = html.unescape(out.read_text())
    assert f"line {len(lines)}) is cut short" in text
    assert f"<td>{len(lines) - 1 - sum('eval' in x for x in lines[:-1])}</td>" in text  # train steps logged


def test_without_matplotlib_the_page_keeps_its_tables(made, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "r.html"
    notes = page.write_report([str(made / "bench.json")], out)
    text = out.read_text()
    assert any("charts are left out" in n for n in notes)
    assert "<img" not in text and "charts need matplotlib" in text and "<table>" in text


def test_plan_plot_draws_through_the_report_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert cli_main(["plan", "default", "--hardware", "h200", "--batch", "1,8", "--k", "1,2",
                     "--plot", str(tmp_path / "plots")]) == 0
    for name in ("speedup_vs_k_batch1.png", "speedup_vs_k_batch8.png", "speedup_vs_batch.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_plot_without_matplotlib_is_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli_main(["plan", "default", "--hardware", "h200", "--k", "1,2", "--plot", str(tmp_path / "plots")]) == 0
    assert "plots skipped: matplotlib is not installed" in capsys.readouterr().err
    assert not list((tmp_path / "plots").glob("*.png"))


# ---------------------------------------------------------------------------------------------
# TensorBoard and W&B


def test_tensorboard_events_hold_the_metrics_jsonl_values(made):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea_mod.EventAccumulator(str(made / "run" / "tensorboard"), size_guidance={ea_mod.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    rows = [json.loads(x) for x in (made / "run" / "metrics.jsonl").read_text().splitlines()]
    expected: dict[str, dict[int, float]] = {}
    for r in rows:
        for key, v in r.items():
            if key in ("type", "step", "source", "best", "ahead"):
                continue
            for tag, value in ([(f"{r['type']}/{key}", v)] if not isinstance(v, list)
                               else [(f"{r['type']}/{key}/{i}", x) for i, x in enumerate(v)]):
                expected.setdefault(tag, {})[r["step"]] = value
    assert len(list((made / "run" / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert tags == set(expected)
    assert {"train/loss", "train/sim_tau_k", "train/tokens_per_s", "eval/walk_tau_k", "train/per_step_acc/2"} <= tags
    for tag, by_step in expected.items():
        events = acc.Scalars(tag)
        got = {e.step: e.value for e in events}
        assert got.keys() == by_step.keys() and len(events) == len(by_step), tag  # no step twice
        for step, value in by_step.items():
            assert got[step] == pytest.approx(value, rel=1e-6, abs=1e-6), (tag, step)


def test_report_to_needs_its_package(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(UserError, match="needs the tensorboard package"):
        logs.require("tensorboard")
    monkeypatch.setitem(sys.modules, "wandb", None)
    target = tmp_path / "absent-target"
    _one_line_error(capsys, ["train", str(target), "--data", str(tmp_path / "d"), "--out", str(tmp_path / "run"),
                             "--report-to", "wandb"], "needs the wandb package")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# Headless Chromium


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _render(browser: str, page_path: Path, shot: Path) -> str:
    """Screenshot ``page_path``; the browser's log (console messages and failed loads among it)."""
    run = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--enable-logging=stderr", "--v=0", "--window-size=1280,3000", f"--screenshot={shot}",
                          page_path.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stderr


def _console_errors(log: str) -> list[str]:
    return [x for x in log.splitlines() if "CONSOLE" in x or "Failed to load" in x or "net::ERR" in x]


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_chromium_renders_the_page_without_console_errors(made, tmp_path):
    browser = _chromium()
    out = tmp_path / "report.html"
    page.write_report([str(made / "run"), str(made / "bench.json"), str(made / "plan.json"),
                       str(made / "tplan.json")], out)
    shot = tmp_path / "report.png"
    assert _console_errors(_render(browser, out, shot)) == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
    broken = tmp_path / "broken.html"  # the check can fail: a page with a script error and a missing image
    broken.write_text('<!DOCTYPE html><html><body><img src="missing.png"><script>console.error("x");</script>'
                      "</body></html>")
    assert _console_errors(_render(browser, broken, tmp_path / "broken.png"))
