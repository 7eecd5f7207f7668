"""`outrider bench` end to end on a tiny target folder: the record, the transformers baseline,
and bad input as one line with exit status 2."""

from __future__ import annotations

import json

import pytest

from outrider.cli import main as cli_main


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("w5 w6 w7 w5 w6 w7\nw9 w10 w11 w12 w9 w10\n")
    return path


def test_bench_writes_a_lossless_record_with_the_transformers_baseline(tiny_dir, prompts, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = cli_main(["bench", str(tiny_dir("llama")), "--method", "ngram", "--k", "3", "--prompts", str(prompts),
                   "--num-prompts", "2", "--max-new-tokens", "12", "--hf-baseline", "--repeats", "2",
                   "--json", str(out)])
    assert rc in (0, None)
    (record,) = json.loads(out.read_text())
    assert record["lossless"] is True and record["hf_agreement"] == 1.0
    assert record["new_tokens"] > 0 and record["hf_tokens_per_s"] > 0 and record["ar_tokens_per_s"] > 0
    assert len(record["accept_rate_per_pos"]) == 3 and record["tau"] >= 1.0
    assert record["step_ms"] >= record["verify_step_ms"] > 0 and record["draft_step_ms"] >= 0
    assert record["prompt_draft_ms"] > 0  # each request's first draft, from its prompt, timed on its own
    assert record["prefill_ms"] > 0 and record["ar_prefill_ms"] > 0
    assert record["decode_speedup_vs_ar"] > 0 and record["repeats"] == 2 and len(record["speedup_per_pass"]) == 2
    assert record["speedup_vs_ar"] == pytest.approx(sum(record["speedup_per_pass"]) / 2)  # median of two
    assert 0.0 <= record["repeated_4grams"] <= 1.0
    taus, steps = record["tau_per_batch"], record["row_steps_per_batch"]  # batch 1: one per prompt
    assert len(taus) == len(steps) == 2 and min(steps) > 0
    assert sum(t * n for t, n in zip(taus, steps)) / sum(steps) == pytest.approx(record["tau"])  # passes agree
    # the bar counts every timed batch: 2 prompts x (2 x 2 passes + transformers' pass)
    bar = [line for line in capsys.readouterr().err.splitlines() if "bench ngram vs ar" in line]
    assert bar and "10/10" in bar[-1]
    rc = cli_main(["bench", str(tiny_dir("llama")), "--method", "ngram", "--prompts", str(prompts),
                   "--num-prompts", "1", "--max-new-tokens", "4", "--quiet"])
    assert rc in (0, None) and "bench ngram vs ar" not in capsys.readouterr().err


def test_repeated_ngrams_counts_the_continuations_repeats():
    from outrider.bench.local import repeated_ngrams

    assert repeated_ngrams([1, 2, 3], [4, 1, 2, 3, 4, 5]) == (1, 6)  # (1, 2, 3, 4) comes back once
    assert repeated_ngrams([], [7, 7, 7, 7, 7, 7]) == (2, 3)  # a loop: every 4-gram after the first
    assert repeated_ngrams([1, 2, 3, 4], []) == (0, 0)


@pytest.mark.parametrize("args, message", [
    (["--k", "0"], "--k: must be an integer in 1..64"),
    (["--method", "nope"], "invalid choice: 'nope'"),
    (["--method", "ngram", "--repeats", "0"], "--repeats: must be an integer >= 1"),
])
def test_bench_bad_input_is_one_line_exit_2(tiny_dir, prompts, capsys, args, message):
    rc = cli_main(["bench", str(tiny_dir("llama")), "--prompts", str(prompts), "--num-prompts", "1",
                   "--max-new-tokens", "4", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1


def test_bench_missing_target_folder(tmp_path, capsys):
    rc = cli_main(["bench", str(tmp_path / "missing"), "--method", "ngram"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "missing" in err


def test_bench_logs_each_phase_as_it_ends(tiny_dir, prompts):
    """``log`` hears of the warm-ups (where compilation and capture happen) and of every pass, in
    order, so that a benchmark cut by a time limit still says how far it got."""
    from outrider.bench.local import bench

    lines: list[str] = []
    record = bench(str(tiny_dir("llama")), "ngram", k=2, num_prompts=2, prompts=str(prompts), max_new_tokens=6,
                   repeats=2, log=lines.append)
    assert record["lossless"] is True
    assert [line.split(":")[0] for line in lines] == ["warm-up of the autoregressive engine",
                                                      "warm-up of the ngram engine", "pass 1 of 2", "pass 2 of 2"]
    assert all(line.endswith(" s") for line in lines)
