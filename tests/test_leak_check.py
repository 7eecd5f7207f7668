"""``benchmarks/leak_check.py``: benchmark prompts found in a token dataset written by the data pipeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from outrider import assets
from outrider.train.data.datasets import _write_split

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "leak_check.py"


def leak_check(*args: str) -> subprocess.CompletedProcess:
    """The script as a user runs it."""
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)

TASK = "Create a new Python file in this folder called task.py.\n* Write a program with two errors"


@pytest.fixture(scope="module")
def real_tokenizer():
    if not (assets.default_model_dir() / "config.json").exists():
        pytest.skip("default model not pulled (run `outrider pull`)")
    from outrider.models import load_tokenizer

    return load_tokenizer("default")


def _dataset(path: Path, tokenizer, prompts: list[str]) -> Path:
    rows = []
    for i, p in enumerate(prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": "Sure."}],
                                            tokenize=True, return_dict=False)
        rows.append((f"c{i}", list(ids), [1] * len(ids)))
    path.mkdir()
    _write_split(path, "train", rows, shard_rows=2)
    return path


def test_whole_turns_and_cut_tasks_leak_text_inside_longer_prompts_does_not(tmp_path, real_tokenizer):
    data = _dataset(tmp_path / "d", real_tokenizer, [
        "what is  the BEST tactic?", "hello", TASK + "\nNext to each error, add a comment",
        "write a python script to send an email"])
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["What is the best tactic?", TASK, "write a python script", "never seen"]))
    out = tmp_path / "r.json"
    run = leak_check("--data", str(data), "--prompts", str(prompts), "--out", str(out))
    result = json.loads(out.read_text())
    assert run.returncode == 1 and result["examples"] == 4 and result["leaked"] == [0, 1]
    assert result["counts"] == [{"turn": 1, "prefix": 0, "inside": 0}, {"turn": 0, "prefix": 1, "inside": 0},
                                {"turn": 0, "prefix": 0, "inside": 1}, {"turn": 0, "prefix": 0, "inside": 0}]
    assert "LEAK prompt 1" in run.stdout
    prompts.write_text(json.dumps(["write a python script", "never seen"]))
    assert leak_check("--data", str(data), "--prompts", str(prompts)).returncode == 0


def test_bad_input_is_one_line_and_status_2(tmp_path, real_tokenizer):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["hi"]))
    runs = [leak_check("--data", str(tmp_path), "--prompts", str(prompts)),
            leak_check("--data", str(tmp_path), "--prompts", str(tmp_path / "none.json"))]
    assert [r.returncode for r in runs] == [2, 2]
    errs = [r.stderr.strip().splitlines() for r in runs]
    assert [len(e) for e in errs] == [1, 1]
    assert "no *.parquet shards" in errs[0][0] and "prompt file not found" in errs[1][0]
