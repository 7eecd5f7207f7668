"""``benchmarks/leak_check.py``: benchmark prompts found in a token dataset written by the data pipeline."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from outrider import assets
from outrider.train.datasets import _write_split

_SPEC = importlib.util.spec_from_file_location(
    "leak_check", Path(__file__).resolve().parents[1] / "benchmarks" / "leak_check.py")
leak_check = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(leak_check)

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


def test_whole_turns_and_cut_tasks_leak_text_inside_longer_prompts_does_not(tmp_path, real_tokenizer, capsys):
    data = _dataset(tmp_path / "d", real_tokenizer, [
        "what is  the BEST tactic?", "hello", TASK + "\nNext to each error, add a comment",
        "write a python script to send an email"])
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["What is the best tactic?", TASK, "write a python script", "never seen"]))
    out = tmp_path / "r.json"
    rc = leak_check.main(["--data", str(data), "--prompts", str(prompts), "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 1 and result["examples"] == 4 and result["leaked"] == [0, 1]
    assert result["counts"] == [{"turn": 1, "prefix": 0, "inside": 0}, {"turn": 0, "prefix": 1, "inside": 0},
                                {"turn": 0, "prefix": 0, "inside": 1}, {"turn": 0, "prefix": 0, "inside": 0}]
    assert "LEAK prompt 1" in capsys.readouterr().out
    prompts.write_text(json.dumps(["write a python script", "never seen"]))
    assert leak_check.main(["--data", str(data), "--prompts", str(prompts)]) == 0


def test_bad_input_is_one_line_and_status_2(tmp_path, real_tokenizer, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["hi"]))
    assert leak_check.main(["--data", str(tmp_path), "--prompts", str(prompts)]) == 2
    assert leak_check.main(["--data", str(tmp_path), "--prompts", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no *.parquet shards" in err[0] and "prompt file not found" in err[1]
