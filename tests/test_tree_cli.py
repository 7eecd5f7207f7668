"""Draft trees on the command line: --tree / --tree-paths checked once (one line, exit 2), and
export's LAUNCH.md with the tree flags of SGLang and vLLM (given, or the best measured)."""

from __future__ import annotations

import json

import pytest
from test_export import make_head
from tiny import save_tiny

from outrider.cli import main
from outrider.interop.formats.export import save_head


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    target = save_tiny("llama", tmp_path_factory.mktemp("target"), seed=0, layers=8)
    out = tmp_path_factory.mktemp("head")
    save_head(make_head(target), out, target=str(target))
    return target, out


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("extra, says", [
    (["--method", "ngram", "--tree", "2,3,6"], "--method eagle3"),
    (["--method", "eagle3", "--tree", "2,3,30"], "can draft"),
    (["--method", "eagle3", "--tree", "0,3,4"], ">= 1"),
    (["--method", "eagle3", "--tree", "2,3"], "TOPK,STEPS,TOKENS"),
    (["--method", "eagle3", "--tree", "2,3,6", "--tree-paths", "x"], "choose one"),
])
def test_bad_trees_are_one_line(capsys, head_dir, extra, says):
    target, head = head_dir
    draft = ["--draft", str(head)] if "eagle3" in extra else []
    assert says in _one_line(capsys, ["bench", str(target), *extra, *draft])


def test_a_tree_paths_file_that_is_not_a_tree(capsys, head_dir, tmp_path):
    target, head = head_dir
    for text, says in [("[(0,), (0, 1)]", "skips the rank"), ("[(0, 0)]", "no parent"), ("nonsense(", "not a list")]:
        f = tmp_path / "tree.txt"
        f.write_text(text)
        err = _one_line(capsys, ["generate", str(target), "--prompt", "hi", "--method", "eagle3", "--draft", str(head),
                                 "--tree-paths", str(f)])
        assert says in err and str(f) in err
    assert "No such file" in _one_line(capsys, ["bench", str(target), "--method", "eagle3", "--draft", str(head),
                                                "--tree-paths", str(tmp_path / "missing")])


def test_export_writes_the_tree_flags(head_dir, tmp_path, capsys):
    target, head = head_dir
    assert main(["export", str(head), "--format", "sglang", "--out", str(tmp_path / "a"), "--tree", "4,3,10"]) == 0
    text = (tmp_path / "a" / "LAUNCH.md").read_text()
    assert "--speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 10" in text
    paths = tmp_path / "paths.txt"
    paths.write_text("[(0,), (1,), (0, 0), (1, 0)]")
    capsys.readouterr()
    assert main(["export", str(head), "--format", "vllm", "--out", str(tmp_path / "b"), "--tree-paths", str(paths)]) == 0
    notice = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("notice:")]
    assert len(notice) == 1 and "vLLM serves chains and parallel drafting only" in notice[0]
    text = (tmp_path / "b" / "LAUNCH.md").read_text()
    vllm = text.split("## vLLM", 1)[1].split("## SGLang", 1)[0]  # vLLM serves no trees: the chain of the depth
    assert '"num_speculative_tokens": 2}' in vllm and "Checked on vLLM 0.32.0" in vllm
    assert "speculative_token_tree" not in vllm.split("```")[1] and "TREE_ATTN" not in text
    assert "--speculative-eagle-topk 2 --speculative-num-draft-tokens 5" in text  # SGLang: the same width and size


def test_export_launches_the_best_measured_chain_or_tree(head_dir, tmp_path, capsys):
    target, head = head_dir
    records = [{"method": "eagle3", "k": 5, "tau": 2.1, "speedup_vs_ar": 1.4},
               {"method": "eagle3", "k": 4, "topk": 4, "steps": 4, "draft_tokens": 16, "tau": 2.6, "speedup_vs_ar": 1.6},
               {"method": "ngram", "k": 3, "tau": 1.2, "speedup_vs_ar": 2.0}]
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(records))
    assert main(["export", str(head), "--format", "sglang", "--out", str(tmp_path / "c"), "--bench", str(f)]) == 0
    assert "--speculative-eagle-topk 4 --speculative-num-draft-tokens 16" in (tmp_path / "c" / "LAUNCH.md").read_text()
    records[0]["speedup_vs_ar"] = 1.7
    f.write_text(json.dumps(records))
    assert main(["export", str(head), "--format", "sglang", "--out", str(tmp_path / "d"), "--bench", str(f)]) == 0
    assert "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6" in \
        (tmp_path / "d" / "LAUNCH.md").read_text()
    f.write_text("[]")
    assert "no eagle3 bench record" in _one_line(capsys, ["export", str(head), "--format", "sglang", "--out",
                                                          str(tmp_path / "e"), "--bench", str(f)])
