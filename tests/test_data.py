"""Training data: readers, template-derived loss masks, truncation, splits, Parquet, regeneration."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import CHAT_TEMPLATE, make_tiny, save_tiny, tiny_config, tiny_tokenizer

from outrider import assets, sharegpt
from outrider.errors import UserError
from outrider.train.data.conversations import Dropped, normalise_record
from outrider.train.data.datasets import (
    TokenDataset,
    load_dataset,
    merge_datasets,
    opening,
    read_manifest,
    split_overlap,
    subset_dataset,
)
from outrider.train.data.prepare import build_dataset
from outrider.train.data.regenerate import cache_path_for, hf_generate_fn
from outrider.train.data.template import end_token_ids, tokenize_conversation

SYS, U1, A1, U2, A2 = "w5 w6", "w7", "w8 w9", "w10 w11 w12", "w13"


def two_turns():
    return [{"role": "system", "content": SYS}, {"role": "user", "content": U1}, {"role": "assistant", "content": A1},
            {"role": "user", "content": U2}, {"role": "assistant", "content": A2}]


def sharegpt_record(conv_id, turns):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"id": conv_id, "conversations": [{"from": names[r], "value": c} for r, c in turns]}


def openai_record(conv_id, turns):
    return {"id": conv_id, "messages": [{"role": r, "content": c} for r, c in turns]}


def many_conversations(n, start=0):
    """n conversations of 1-3 exchanges, deterministic, words only from the tiny vocabulary."""
    rng = np.random.default_rng(start)
    convs = []
    for k in range(start, start + n):
        turns = [("system", "w5")] if k % 3 == 0 else []
        for _ in range(1 + k % 3):
            turns.append(("user", " ".join(f"w{int(w)}" for w in rng.integers(5, 90, size=3))))
            turns.append(("assistant", " ".join(f"w{int(w)}" for w in rng.integers(5, 90, size=1 + k % 4))))
        convs.append((f"c{k}", turns))
    return convs


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A config-and-tokenizer folder: enough for data without regeneration."""
    d = tmp_path_factory.mktemp("target")
    tiny_config().save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return str(save_tiny("llama", tmp_path_factory.mktemp("tiny_target")))


def write_json(path: Path, records) -> str:
    path.write_text(json.dumps(records))
    return str(path)


def write_jsonl(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# ------------------------------------------------------------------------------------ masks


def test_exact_mask_two_turns_with_system(tok):
    got = tokenize_conversation(tok, two_turns(), 100, end_token_ids(tok))
    S, E, sysid, user, asst = 3, 2, 93, 94, 95  # <|im_start|>, <|im_end|>, role words
    expect_ids = [S, sysid, 5, 6, E,  S, user, 7, E,  S, asst, 8, 9, E,  S, user, 10, 11, 12, E,  S, asst, 13, E]
    expect_mask = [0, 0, 0, 0, 0,     0, 0, 0, 0,     0, 0, 1, 1, 1,     0, 0, 0, 0, 0, 0,         0, 0, 1, 1]
    assert got.input_ids == expect_ids
    assert got.loss_mask == expect_mask
    assert not got.truncated
    whole = tok.apply_chat_template(two_turns(), tokenize=True, return_dict=False)
    assert got.input_ids == list(whole)  # the same ids the template itself produces


def test_many_turns_mask_is_assistant_text_plus_end_token(tok):
    convs = many_conversations(12)
    for _, turns in convs:
        messages = [{"role": r, "content": c} for r, c in turns]
        got = tokenize_conversation(tok, messages, 1000, [tok.eos_token_id])
        runs, run = [], []
        for t, m in zip(got.input_ids, got.loss_mask):
            if m:
                run.append(t)
            elif run:
                runs.append(run)
                run = []
        if run:
            runs.append(run)
        expected = [tok.encode(c, add_special_tokens=False) + [tok.eos_token_id] for r, c in turns if r == "assistant"]
        assert runs == expected


def test_bytelevel_bpe_excludes_the_newline_after_the_end_token():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["Hello there, how are you today?", "I am fine, thank you.\nAnd you?",
              "Sure! Here is some code:\n  x = 1"] * 5
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE  # ChatML: a newline follows every <|im_end|>
    messages = [{"role": "user", "content": "Hello there, how are you today?"},
                {"role": "assistant", "content": "I am fine, thank you.\nAnd you?"},
                {"role": "user", "content": "Sure!"},
                {"role": "assistant", "content": " Here is some code:\n  x = 1"}]
    got = tokenize_conversation(fast, messages, 1000, [fast.eos_token_id])
    assert got.input_ids == list(fast.apply_chat_template(messages, tokenize=True, return_dict=False))
    masked = [t for t, m in zip(got.input_ids, got.loss_mask) if m]
    assert fast.decode(masked) == "I am fine, thank you.\nAnd you?<|im_end|> Here is some code:\n  x = 1<|im_end|>"
    assert got.loss_mask[-1] == 0 and fast.decode(got.input_ids[-1:]) == "\n"


def test_tokenizer_without_offsets_whose_pieces_tokenise_differently():
    """SentencePiece-style prefix space: a turn tokenised alone differs; boundaries come from prefixes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for w in ["hi", "there", "how", "are", "you", "fine", "thanks", "sys", "prompt"]:
        vocab[w] = len(vocab)
        vocab["\u2581" + w] = len(vocab)
    sp = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    sp.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    fast = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"])
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                          "{% if m['role'] == 'assistant' %}</s>{% endif %}{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    messages = [{"role": "system", "content": "sys prompt"}, {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "how are you"}, {"role": "user", "content": "fine"},
                {"role": "assistant", "content": "thanks"}]
    alone = fast.encode("how are you</s>", add_special_tokens=False)
    got = tokenize_conversation(fast, messages, 100, [fast.eos_token_id])
    assert got.input_ids == list(fast.apply_chat_template(messages, tokenize=True, return_dict=False))
    masked = [t for t, m in zip(got.input_ids, got.loss_mask) if m]
    assert fast.convert_ids_to_tokens(masked) == ["how", "\u2581are", "\u2581you", "</s>", "thanks", "</s>"]
    assert alone[0] != masked[0]  # the piece alone would have been wrong


def test_templates_that_cannot_be_split_are_dropped():
    unstable = tiny_tokenizer()
    unstable.chat_template = CHAT_TEMPLATE.replace("{{ m['role'] }}\n{{ m['content'] }}",
                                                   "{{ 'bot' if m['role'] == 'assistant' else m['role'] }}\n"
                                                   "{{ m['content'] }}")
    with pytest.raises(Dropped) as e:
        tokenize_conversation(unstable, two_turns(), 100, [2])
    assert e.value.reason == "template_not_prefix_stable"
    glued = tiny_tokenizer()  # the generation prompt ends inside the word the reply starts with
    glued.chat_template = CHAT_TEMPLATE.replace("{{ m['content'] }}", "{{ 'w1' if m['role'] == 'assistant' }}"
                                                "{{ m['content'] }}").replace("assistant\n{% endif %}",
                                                                              "assistant\nw1{% endif %}")
    messages = [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "5 w6"}]
    with pytest.raises(Dropped) as e:
        tokenize_conversation(glued, messages, 100, [2])
    assert e.value.reason == "tokenization_mismatch"


def test_template_that_renders_the_final_reply_differently_learns_the_last_turn(tok):
    """Like Qwen3's empty thinking block: only the final reply carries the marker (here the word w90)."""
    final_marked = tiny_tokenizer()
    final_marked.chat_template = CHAT_TEMPLATE.replace(
        "{{ m['content'] }}", "{% if m['role'] == 'assistant' and loop.last %}w90 {% endif %}{{ m['content'] }}")
    got = tokenize_conversation(final_marked, two_turns(), 100, [2])
    assert got.last_turn_only and not got.truncated
    assert got.input_ids == list(final_marked.apply_chat_template(two_turns(), tokenize=True, return_dict=False))
    assert [t for t, m in zip(got.input_ids, got.loss_mask) if m] == [90, 13, 2]  # "w90 w13 <|im_end|>"
    assert got.input_ids[got.loss_mask.index(1) - 2:got.loss_mask.index(1)] == [3, 95]
    early = tokenize_conversation(final_marked, two_turns(), 16, [2])  # the second reply does not fit
    assert early.last_turn_only and early.truncated
    assert [t for t, m in zip(early.input_ids, early.loss_mask) if m] == [90, 8, 9, 2]


def test_truncation_and_nothing_to_learn(tok):
    full = tokenize_conversation(tok, two_turns(), 100, [2])
    cut = tokenize_conversation(tok, two_turns(), 12, [2])
    assert cut.truncated and cut.input_ids == full.input_ids[:12] and cut.loss_mask == full.loss_mask[:12]
    assert cut.loss_mask == [0] * 11 + [1]
    exact = tokenize_conversation(tok, two_turns(), len(full.input_ids), [2])
    assert not exact.truncated and exact.input_ids == full.input_ids
    with pytest.raises(Dropped) as e:  # the first reply starts at token 11: nothing of it fits in 11
        tokenize_conversation(tok, two_turns(), 11, [2])
    assert e.value.reason == "nothing_to_learn"


def test_normalise_both_schemas_and_roles():
    turns = [("system", "w5"), ("user", "w6"), ("assistant", "w7")]
    want = [{"role": r, "content": c} for r, c in turns]
    assert normalise_record(sharegpt_record("a", turns)) == want
    assert normalise_record(openai_record("a", turns)) == want
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "w6"}]},
                          {"role": "assistant", "content": "w7"}]}
    assert normalise_record(parts)[0] == {"role": "user", "content": "w6"}
    lead = sharegpt_record("b", [("assistant", "w9"), ("user", "w6"), ("assistant", "w7")])
    assert [m["role"] for m in normalise_record(lead)] == ["user", "assistant"]  # a reply to nothing goes
    for bad, reason in [({"conversations": [{"from": "tool", "value": "x"}]}, "unknown_role"),
                        ({"conversations": [{"from": "human", "value": "w6"}]}, "no_assistant_turn"),
                        ({"text": "w6"}, "unrecognised_record")]:
        with pytest.raises(Dropped) as e:
            normalise_record(bad)
        assert e.value.reason == reason


# ------------------------------------------------------------------------------------ datasets on disk


@pytest.mark.parametrize("fmt", ["json-sharegpt", "jsonl-sharegpt", "json-openai", "jsonl-openai"])
def test_build_roundtrip_all_formats(tmp_path, target, tok, fmt):
    convs = many_conversations(30)
    container, schema = fmt.split("-")
    make = sharegpt_record if schema == "sharegpt" else openai_record
    records = [make(cid, turns) for cid, turns in convs]
    records.insert(5, make("lonely", [("user", "w6")]))  # no assistant turn: skipped, counted
    src = (write_json if container == "json" else write_jsonl)(tmp_path / f"data.{container}", records)
    report = build_dataset(target, src, str(tmp_path / "out"), max_length=24, eval_fraction=0.2, seed=3,
                           progress=False, shard_rows=7)
    assert report.dropped.get("no_assistant_turn") == 1 and report.scanned == 31
    assert report.kept + sum(v for k, v in report.dropped.items() if k != "no_assistant_turn") == 30
    assert report.train + report.eval == report.kept and report.eval == round(0.2 * report.kept)
    manifest = read_manifest(tmp_path / "out")
    assert manifest["max_length"] == 24 and manifest["seed"] == 3
    assert manifest["tokenizer"]["vocab_size"] == len(tok)
    assert manifest["counts"]["dropped"] == report.dropped
    assert len(manifest["splits"]["train"]["shards"]) == -(-report.train // 7)
    by_id = {cid: [{"role": r, "content": c} for r, c in turns] for cid, turns in convs}
    total = loss = 0
    for split in ("train", "eval"):
        ds = load_dataset(tmp_path / "out", split)
        assert len(ds) == manifest["splits"][split]["examples"]
        assert ds.num_tokens == manifest["splits"][split]["tokens"]
        for i in range(len(ds)):
            ids, mask = ds[i]
            want = tokenize_conversation(tok, by_id[ds.conv_ids[i]], 24, [2])
            assert ids.tolist() == want.input_ids and mask.tolist() == want.loss_mask
            assert len(ids) <= 24 and mask.sum() > 0
        total += ds.num_tokens
        loss += ds.num_loss_tokens
    assert (total, loss) == (report.tokens, report.loss_tokens)
    assert report.truncated > 0  # max_length 24 cuts the long ones


def test_tokenising_over_worker_processes_writes_what_one_process_writes(tmp_path, target):
    """``build_dataset(workers=2)`` tokenises in two spawned processes, chunk by chunk: the same rows
    in the same order, the same drops and counts as one process."""
    convs = many_conversations(1100)
    records = [openai_record(cid, turns) for cid, turns in convs]
    records += [openai_record("again", convs[7][1]), openai_record("lonely", [("user", "w6")])]  # a duplicate, no reply
    src = write_jsonl(tmp_path / "d.jsonl", records)
    one = build_dataset(target, src, str(tmp_path / "one"), max_length=24, progress=False, workers=1)
    two = build_dataset(target, src, str(tmp_path / "two"), max_length=24, progress=False, workers=2)
    assert {**one.to_dict(), "out": ""} == {**two.to_dict(), "out": ""}
    assert one.dropped["duplicate"] == 1 and one.dropped["no_assistant_turn"] == 1 and one.kept > 1000
    for split in ("train", "eval"):
        a, b = load_dataset(tmp_path / "one", split), load_dataset(tmp_path / "two", split)
        assert a.conv_ids == b.conv_ids
        assert all(torch.equal(*map(torch.as_tensor, pair)) for i in range(len(a)) for pair in zip(a[i], b[i]))


def test_workers_that_cannot_start_leave_the_tokenising_to_the_caller(target):
    """A script read from standard input cannot be re-imported by a spawned worker: the pool breaks,
    and what is left is tokenised in the calling process, to the same result."""
    import subprocess
    import sys

    script = f"""
from outrider.models import load_tokenizer
from outrider.train.data.template import tokenize_many
tok = load_tokenizer({target!r})
convs = [[{{"role": "user", "content": f"w{{5 + i % 80}} w7"}}, {{"role": "assistant", "content": "w9 w11"}}]
         for i in range(1100)]
seen = []
out = tokenize_many(tok, convs, 24, [2], workers=2, advance=seen.append)
print(out == tokenize_many(tok, convs, 24, [2], workers=1), sum(seen), len(out))
"""
    run = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "1100", "1100"]
    assert "tokenising in this process: its 2 workers could not run (BrokenProcessPool)" in run.stderr


def test_split_is_a_function_of_the_seed(tmp_path, target):
    src = write_jsonl(tmp_path / "d.jsonl", [openai_record(c, t) for c, t in many_conversations(40)])

    def eval_ids(seed, name):
        build_dataset(target, src, str(tmp_path / name), eval_fraction=0.25, seed=seed, progress=False)
        return load_dataset(tmp_path / name, "eval").conv_ids, load_dataset(tmp_path / name, "train").conv_ids

    a, a_train = eval_ids(0, "a")
    b, _ = eval_ids(0, "b")
    c, _ = eval_ids(1, "c")
    assert a == b and a != c and len(a) == len(c) == 10
    assert not set(a) & set(a_train) and len(set(a) | set(a_train)) == 40


def test_split_keeps_examples_with_one_opening_on_one_side(tmp_path, target):
    """The demo's later exchanges open as their conversation's first does, and prompts repeat with
    other replies: no eval text may start as a train text does (a head would recall it)."""
    records = []
    for c, turns in many_conversations(30):
        first = turns[:3] if turns[0][0] == "system" else turns[:2]
        records.append(openai_record(c, first))
        if len(turns) > len(first):
            records.append(openai_record(f"{c}#2", first + turns[len(first):len(first) + 2]))
        records.append(openai_record(f"{c}#again", first[:-1] + [("assistant", "w3 " + first[-1][1])]))
    src = write_jsonl(tmp_path / "d.jsonl", records)
    build_dataset(target, src, str(tmp_path / "out"), eval_fraction=0.25, seed=0, progress=False)
    train, held = load_dataset(tmp_path / "out", "train"), load_dataset(tmp_path / "out", "eval")
    assert read_manifest(tmp_path / "out")["split_by"] == "opening"
    assert len(held) >= round(0.25 * len(records)) and len(train) + len(held) == len(records)
    train_openings = {opening(i, m) for i, m in zip(train.input_ids, train.loss_mask)}
    assert not train_openings & {opening(i, m) for i, m in zip(held.input_ids, held.loss_mask)}
    assert {c.split("#")[0] for c in held.conv_ids}.isdisjoint(c.split("#")[0] for c in train.conv_ids)
    clean = split_overlap(train, held)
    assert clean["seen_loss_tokens"] == clean["shared_openings"] == 0 and clean["examples"] == len(held)

    # the same examples split one by one leave a first exchange in eval and its later one in train
    first = [i for i, c in enumerate(held.conv_ids) if "#" not in c][0]
    twins = [i for i, c in enumerate(held.conv_ids) if c.split("#")[0] == held.conv_ids[first] and i != first]
    moved = TokenDataset(train.input_ids + [held.input_ids[i] for i in twins],
                         train.loss_mask + [held.loss_mask[i] for i in twins], [], train.manifest)
    alone = TokenDataset([held.input_ids[first]], [held.loss_mask[first]], [], held.manifest)
    leak = split_overlap(moved, alone)
    learned = int(held.loss_mask[first].sum())
    assert leak["shared_openings"] == 1
    # a later exchange holds the whole first one; a repeated prompt only its opening (its reply differs at once)
    later = any(held.conv_ids[i].endswith("#2") for i in twins)
    assert leak["seen_examples"] == int(later) and leak["seen_loss_tokens"] == (learned if later else 0), leak


def test_split_of_examples_with_a_single_opening_draws_them_one_by_one(tmp_path, target):
    records = [openai_record(f"c{k}", [("user", "w7"), ("assistant", f"w{10 + k} w8")]) for k in range(8)]
    build_dataset(target, write_jsonl(tmp_path / "d.jsonl", records), str(tmp_path / "out"), eval_fraction=0.25,
                  progress=False)
    assert read_manifest(tmp_path / "out")["split_by"] == "example"
    assert len(load_dataset(tmp_path / "out", "eval")) == 2 and len(load_dataset(tmp_path / "out", "train")) == 6


def test_merge_keeps_each_split_and_drops_examples_seen_before(tmp_path, target):
    first = many_conversations(30)
    # b repeats a's first ten conversations under other ids, and reuses ids c0..c9 for new ones
    again = [(f"again{c}", t) for c, t in first[:10]]
    reused = [(f"c{i}", t) for i, (_, t) in enumerate(many_conversations(10, start=100))]
    a = write_jsonl(tmp_path / "a.jsonl", [openai_record(c, t) for c, t in first])
    b = write_jsonl(tmp_path / "b.jsonl", [openai_record(c, t) for c, t in again + reused])
    for name, src in (("a", a), ("b", b)):
        build_dataset(target, src, str(tmp_path / name), eval_fraction=0.2, progress=False)
    manifest = merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "m", shard_rows=16)
    parts = {n: {s: load_dataset(tmp_path / n, s) for s in ("train", "eval")} for n in ("a", "b", "m")}
    for split in ("train", "eval"):
        want = list(parts["a"][split].conv_ids) + [c for c in parts["b"][split].conv_ids if not c.startswith("again")]
        got = parts["m"][split]
        assert got.conv_ids == want
        for i, conv in enumerate(got.conv_ids):  # the tokens travel with their conversation
            source = parts["a" if i < len(parts["a"][split]) else "b"][split]
            j = source.conv_ids.index(conv)
            assert np.array_equal(got.input_ids[i], source.input_ids[j])
            assert np.array_equal(got.loss_mask[i], source.loss_mask[j])
    assert manifest["counts"]["dropped"] == {"duplicate": 10} and manifest["counts"]["kept"] == 40
    assert len(manifest["splits"]["train"]["shards"]) > 1 and read_manifest(tmp_path / "m") == manifest


def test_subset_keeps_the_long_examples_of_both_splits(tmp_path, target):
    src = write_jsonl(tmp_path / "a.jsonl", [openai_record(c, t) for c, t in many_conversations(30)])
    build_dataset(target, src, str(tmp_path / "a"), eval_fraction=0.2, progress=False)
    whole = {s: load_dataset(tmp_path / "a", s) for s in ("train", "eval")}
    cut = int(np.median(whole["train"].lengths))
    manifest = subset_dataset(tmp_path / "a", tmp_path / "long", cut)
    for split, ds in whole.items():
        got = load_dataset(tmp_path / "long", split)
        want = [i for i, n in enumerate(ds.lengths) if n >= cut]
        assert 0 < len(want) and (len(want) < len(ds) or split == "eval")
        assert got.conv_ids == [ds.conv_ids[i] for i in want]
        assert all(np.array_equal(a, ds.input_ids[i]) and np.array_equal(b, ds.loss_mask[i])
                   for a, b, i in zip(got.input_ids, got.loss_mask, want))
        assert manifest["counts"][split] == len(want)
    assert read_manifest(tmp_path / "long") == manifest and manifest["source"]["min_length"] == cut
    with pytest.raises(UserError, match="no training example"):
        subset_dataset(tmp_path / "a", tmp_path / "none", 10 ** 6)
    assert not (tmp_path / "none").exists()


def test_merge_refuses_other_tokenisations_and_a_single_directory(tmp_path, target):
    src = write_jsonl(tmp_path / "a.jsonl", [openai_record(c, t) for c, t in many_conversations(8)])
    build_dataset(target, src, str(tmp_path / "a"), eval_fraction=0.0, progress=False)
    build_dataset(target, src, str(tmp_path / "b"), eval_fraction=0.0, progress=False)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    manifest["tokenizer"].update(pad_token_id=1, end_token_ids=[1, 2])  # another conversion of one model
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    merged = merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "ok")
    assert merged["tokenizer"]["pad_token_id"] == read_manifest(tmp_path / "a")["tokenizer"]["pad_token_id"]
    assert set(merged["tokenizer"]["end_token_ids"]) >= {1, 2} and merged["counts"]["dropped"] == {"duplicate": 8}
    manifest["tokenizer"]["chat_template_hash"] = "0" * 64
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="chat_template_hash differs"):
        merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    with pytest.raises(UserError, match="at least two"):
        merge_datasets([tmp_path / "a"], tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_batches_are_padded_deterministic_and_shard_by_rank(tmp_path, target):
    src = write_json(tmp_path / "d.json", [sharegpt_record(c, t) for c, t in many_conversations(23)])
    build_dataset(target, src, str(tmp_path / "out"), eval_fraction=0.0, progress=False)
    ds = load_dataset(tmp_path / "out")
    assert len(ds) == 23
    one = list(ds.batches(8, seed=5, epoch=1))
    again = list(ds.batches(8, seed=5, epoch=1))
    other = list(ds.batches(8, seed=5, epoch=2))
    assert len(one) == 2  # drop_last
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(one, again))
    assert not torch.equal(one[0].indices, other[0].indices)
    for b in one:
        for row, i in enumerate(b.indices.tolist()):
            ids, mask = ds[i]
            n = len(ids)
            assert b.attention_mask[row].sum() == n and b.attention_mask[row, :n].all()
            assert torch.equal(b.input_ids[row, :n], ids) and (b.input_ids[row, n:] == ds.pad_token_id).all()
            assert torch.equal(b.loss_mask[row, :n], mask) and not b.loss_mask[row, n:].any()
    ranks = [list(ds.batches(4, seed=5, epoch=1, rank=r, world_size=2)) for r in range(2)]
    for step, b in enumerate(one):
        union = sorted(ranks[0][step].indices.tolist() + ranks[1][step].indices.tolist())
        assert union == sorted(b.indices.tolist())
    resumed = list(ds.batches(8, seed=5, epoch=1, start=1))
    assert len(resumed) == 1 and torch.equal(resumed[0].input_ids, one[1].input_ids)
    tail = list(ds.batches(8, seed=5, epoch=1, drop_last=False))
    assert len(tail) == 3 and len(tail[2].indices) == 7
    assert ds.collate([0, 1], pad_to_multiple_of=16).input_ids.shape[1] % 16 == 0


def test_length_grouped_batches_cover_the_epoch_with_less_padding(tmp_path, target):
    src = write_json(tmp_path / "d.json", [sharegpt_record(c, t) for c, t in many_conversations(64)])
    build_dataset(target, src, str(tmp_path / "out"), eval_fraction=0.0, progress=False)
    ds = load_dataset(tmp_path / "out")
    plain = ds.global_batches(4, seed=3, epoch=0)
    grouped = ds.global_batches(4, seed=3, epoch=0, group_by_length=8)
    assert sorted(np.concatenate(grouped).tolist()) == sorted(np.concatenate(plain).tolist())
    assert [b.tolist() for b in grouped] == [b.tolist() for b in ds.global_batches(4, seed=3, group_by_length=8)]
    lengths = ds.lengths

    def padded(plan):
        return sum(len(b) * int(lengths[b].max()) for b in plan)

    assert padded(grouped) < padded(plain)
    ranks = [list(ds.batches(2, seed=3, rank=r, world_size=2, group_by_length=8)) for r in range(2)]
    single = list(ds.batches(4, seed=3, group_by_length=8))
    for step, b in enumerate(single):
        union = sorted(ranks[0][step].indices.tolist() + ranks[1][step].indices.tolist())
        assert union == sorted(b.indices.tolist())


def test_heldout_conversations_never_reach_training_data(tmp_path, monkeypatch, target):
    monkeypatch.setenv("OUTRIDER_HOME", str(tmp_path / "home"))
    convs = many_conversations(300)
    held = {c for c, _ in convs if sharegpt.heldout(c)}
    assert 0 < len(held) < 30
    # a held-out conversation's prompt again under a training-split id, spaced and cased otherwise
    c0, turns0 = next((c, t) for c, t in convs if c in held)
    prompt = next(text for role, text in turns0 if role == "user")
    copy = next(f"x{i}" for i in range(1000) if not sharegpt.heldout(f"x{i}"))
    convs.append((copy, [("user", "  " + prompt.upper().replace(" ", "\n")), ("assistant", "w7 w8")]))
    held.add(copy)
    path = assets.sharegpt_path()
    path.parent.mkdir(parents=True)
    write_json(path, [sharegpt_record(c, t) for c, t in convs])
    report = build_dataset(target, "sharegpt", str(tmp_path / "out"), eval_fraction=0.1, progress=False)
    assert report.heldout_excluded == len(held) and report.scanned == 301 - len(held)
    seen = set(load_dataset(tmp_path / "out", "train").conv_ids) | set(load_dataset(tmp_path / "out", "eval").conv_ids)
    assert seen and not seen & held
    limited = build_dataset(target, "sharegpt", str(tmp_path / "out2"), max_conversations=50, progress=False)
    assert limited.scanned == 50 and limited.kept == 50


def test_rebuild_replaces_the_output_atomically(tmp_path, target):
    src = write_jsonl(tmp_path / "d.jsonl", [openai_record(c, t) for c, t in many_conversations(10)])
    out = tmp_path / "out"
    build_dataset(target, src, str(out), max_conversations=4, eval_fraction=0.0, progress=False)
    build_dataset(target, src, str(out), max_conversations=6, eval_fraction=0.0, progress=False)
    assert len(load_dataset(out)) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "out"]  # no temporary left over


# ------------------------------------------------------------------------------------ bad input


def test_bad_inputs_are_one_line_user_errors(tmp_path, target, tok):
    out = str(tmp_path / "out")

    def fails(dataset, match, tgt=target):
        with pytest.raises(UserError, match=match) as e:
            build_dataset(tgt, dataset, out, progress=False)
        assert "\n" not in str(e.value)

    (tmp_path / "empty.jsonl").write_text("")
    fails(str(tmp_path / "empty.jsonl"), "is empty")
    fails(write_json(tmp_path / "list.json", []), "holds no conversations")
    (tmp_path / "prose.txt").write_text("these are not conversations\nat all\n")
    fails(str(tmp_path / "prose.txt"), "neither JSON nor JSONL")
    (tmp_path / "cut.json").write_text(json.dumps([sharegpt_record("a", [("user", "w5"), ("assistant", "w6")])])[:-9])
    fails(str(tmp_path / "cut.json"), "not valid JSON")
    fails(write_jsonl(tmp_path / "other.jsonl", [{"text": "w5"}]), "no ShareGPT .* or OpenAI")
    no_reply = [sharegpt_record(f"q{k}", [("system", "w5"), ("user", "w6")]) for k in range(3)]
    fails(write_json(tmp_path / "noreply.json", no_reply), "no conversation .* has an assistant turn")
    fails(str(tmp_path / "missing.json"), "dataset not found")
    good = write_json(tmp_path / "good.json", [sharegpt_record("a", [("user", "w5"), ("assistant", "w6")])])
    bare = tmp_path / "bare"
    tiny_config().save_pretrained(bare)
    plain = tiny_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(bare)
    fails(good, "has no chat template", tgt=str(bare))
    with pytest.raises(UserError, match="--regenerate"):
        build_dataset(target, good, out, server="http://127.0.0.1:9", progress=False)
    with pytest.raises(UserError, match="max-length"):
        build_dataset(target, good, out, max_length=2, progress=False)
    assert not (tmp_path / "out").exists()  # nothing was written by any failure


# ------------------------------------------------------------------------------------ regeneration, local


def test_regenerate_turn_by_turn_with_a_generate_fn(tmp_path, target, tok):
    """Each reply is a function of the full prompt so far, so turn 2 sees turn 1's new reply."""
    calls = []

    def generate_fn(prompts, max_new_tokens):
        calls.append(len(prompts))
        return [[5 + (sum(p) % 80), 5 + (len(p) % 80), 2, 7, 7] for p in prompts]  # stops at the end id

    convs = many_conversations(9)
    src = write_json(tmp_path / "d.json", [sharegpt_record(c, t) for c, t in convs])
    report = build_dataset(target, src, str(tmp_path / "out"), regenerate=True, generate_fn=generate_fn,
                           eval_fraction=0.0, progress=False)
    assert report.regenerated == 9 and report.from_cache == 0
    assert calls == [9, 6, 3]  # round r serves every conversation with an r-th reply, batched
    ds = load_dataset(tmp_path / "out")
    for i, cid in enumerate(ds.conv_ids):
        msgs = [{"role": r, "content": c} for r, c in dict(convs)[cid]]
        for k, m in enumerate(msgs):  # replay the expected replies independently
            if m["role"] == "assistant":
                prompt = tok.apply_chat_template(msgs[:k], add_generation_prompt=True, tokenize=True, return_dict=False)
                m["content"] = tok.decode([5 + (sum(prompt) % 80), 5 + (len(prompt) % 80)])
        want = tokenize_conversation(tok, msgs, 2048, [2])
        assert ds[i][0].tolist() == want.input_ids and ds[i][1].tolist() == want.loss_mask
    cache = cache_path_for(tmp_path / "out")
    assert len(cache.read_text().splitlines()) == 9
    again = build_dataset(target, src, str(tmp_path / "out"), regenerate=True, generate_fn=generate_fn,
                          eval_fraction=0.0, progress=False)
    assert again.from_cache == 9 and calls == [9, 6, 3]  # nothing generated the second time
    assert load_dataset(tmp_path / "out").conv_ids == ds.conv_ids


def test_regeneration_under_a_time_budget_stops_between_chunks_and_resumes(tmp_path, monkeypatch, target):
    """Chunks of 4 conversations go in order; a chunk starts only if the last one's pace fits the
    budget; the rest are dropped as over budget, and a rerun goes on from the cache."""
    from types import SimpleNamespace
    import outrider.train.data.regenerate as regen

    clock = [0.0]
    monkeypatch.setattr(regen, "BUDGET_CHUNK", 4)
    monkeypatch.setattr(regen, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def generate_fn(prompts, max_new_tokens):
        clock[0] += 1.0  # one second per batch
        return [[5 + (sum(p) % 80), 2] for p in prompts]

    convs = many_conversations(9)  # 1, 2, 3 exchanges in turn: 3 batches per chunk of 4
    src = write_json(tmp_path / "d.json", [sharegpt_record(c, t) for c, t in convs])
    out = str(tmp_path / "out")
    build_dataset(target, src, out, regenerate=True, generate_fn=generate_fn, eval_fraction=0.0, progress=False,
                  regen_budget_s=5.0, concurrency=1)
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["regenerate"]["conversations"] == 4 and m["regenerate"]["over_budget"] == 5
    assert m["regenerate"]["seconds"] == 3.0 and m["counts"]["dropped"]["over_budget"] == 5
    assert sorted(load_dataset(tmp_path / "out").conv_ids) == ["c0", "c1", "c2", "c3"]
    build_dataset(target, src, out, regenerate=True, generate_fn=generate_fn, eval_fraction=0.0, progress=False,
                  regen_budget_s=5.0, concurrency=1)
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["regenerate"]["from_cache"] == 4 and m["regenerate"]["conversations"] == 8
    assert sorted(load_dataset(tmp_path / "out").conv_ids) == [f"c{i}" for i in range(8)]
    with pytest.raises(UserError, match="time budget"):
        build_dataset(target, src, out, regenerate=True, generate_fn=generate_fn, regen_budget_s=float("nan"))


def test_regenerate_locally_with_the_default_hf_backend(tmp_path, tiny_target, tok):
    convs = many_conversations(4)
    src = write_json(tmp_path / "d.json", [sharegpt_record(c, t) for c, t in convs])
    report = build_dataset(tiny_target, src, str(tmp_path / "out"), regenerate=True, max_new_tokens=6,
                           eval_fraction=0.0, progress=False)
    assert report.regenerated == 4
    model = make_tiny("llama", 0)
    ds = load_dataset(tmp_path / "out")
    cid = ds.conv_ids[0]
    msgs = [{"role": r, "content": c} for r, c in dict(convs)[cid]]
    k = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    prompt = tok.apply_chat_template(msgs[:k], add_generation_prompt=True, tokenize=True, return_dict=False)
    gen = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=2)
    new = gen[0, len(prompt):].tolist()
    new = new[: new.index(2)] if 2 in new else new
    reply = tok.encode(tok.decode(new, skip_special_tokens=True), add_special_tokens=False)
    ids, mask = ds[0]
    start = len(prompt)
    assert ids[:start].tolist() == prompt and mask[:start].sum() == 0
    assert ids[start: start + len(reply)].tolist() == reply and mask[start: start + len(reply)].all()
    assert ids[start + len(reply)] == 2 and mask[start + len(reply)] == 1


def _replies(out_dir) -> list[list[int]]:
    ds = load_dataset(out_dir)
    return [[t for t, m in zip(ds[i][0].tolist(), ds[i][1].tolist()) if m] for i in range(len(ds))]


def test_regenerate_sampled_at_a_temperature(tmp_path, tiny_target):
    src = write_json(tmp_path / "d.json", [sharegpt_record(c, t) for c, t in many_conversations(6)])

    def build(name, **kw):
        return build_dataset(tiny_target, src, str(tmp_path / name), regenerate=True, max_new_tokens=8,
                             eval_fraction=0.0, progress=False, **kw)

    build("a")
    greedy = _replies(tmp_path / "a")
    hot = build("a", temperature=1.0)  # the same folder and cache: the greedy replies do not serve...
    assert hot.from_cache == 0 and read_manifest(tmp_path / "a")["regenerate"]["temperature"] == 1.0
    sampled = _replies(tmp_path / "a")
    assert build("a").from_cache == 0 and _replies(tmp_path / "a") == greedy  # nor serve the samples greedy
    build("b", temperature=1.0)
    assert _replies(tmp_path / "b") == sampled  # a fresh cache, the same seed: the same samples
    build("c", temperature=1.0, seed=1)
    assert sampled != greedy and _replies(tmp_path / "c") != sampled
    assert build("b", temperature=1.0, seed=1).from_cache == 0  # another seed is not served seed 0's
    assert _replies(tmp_path / "b") == _replies(tmp_path / "c")


def test_regeneration_records_batches_the_device_halved(tmp_path, target):
    from outrider.demo import data_note

    src = write_json(tmp_path / "d.json", [sharegpt_record(c, t) for c, t in many_conversations(2)])
    fn = hf_generate_fn(make_tiny("llama", 0), 0, [2])
    build_dataset(target, src, str(tmp_path / "a"), regenerate=True, max_new_tokens=4, eval_fraction=0.0,
                  generate_fn=fn, progress=False)
    assert "batches_halved" not in read_manifest(tmp_path / "a")["regenerate"]
    assert "out of GPU memory" not in data_note(tmp_path / "a")
    fn.splits = 3  # as engine_generate_fn counts the batches it ran again as halves
    build_dataset(target, src, str(tmp_path / "b"), regenerate=True, max_new_tokens=4, eval_fraction=0.0,
                  generate_fn=fn, progress=False)
    assert read_manifest(tmp_path / "b")["regenerate"]["batches_halved"] == 3
    assert "(3 batches out of GPU memory, run again as halves)" in data_note(tmp_path / "b")


def test_sampling_settings_are_checked(tmp_path, target):
    src = write_json(tmp_path / "d.json", [sharegpt_record(c, t) for c, t in many_conversations(2)])
    with pytest.raises(UserError, match="--regenerate"):
        build_dataset(target, src, str(tmp_path / "out"), temperature=0.7, progress=False)
    with pytest.raises(UserError, match=">= 0"):
        build_dataset(target, src, str(tmp_path / "out"), regenerate=True, temperature=-1.0, progress=False)
    greedy_fn = hf_generate_fn(make_tiny("llama", 0), 0, [2])
    with pytest.raises(ValueError, match="temperature 0.0"):
        build_dataset(target, src, str(tmp_path / "out"), regenerate=True, temperature=0.7,
                      generate_fn=greedy_fn, progress=False)
    assert not (tmp_path / "out").exists()


def test_sampled_generate_fns_give_every_row_its_own_stream_and_leave_the_callers_random_state():
    from outrider.demo import engine_generate_fn

    model = make_tiny("llama", 1)
    prompt = [3, 94, 7, 8, 2, 3, 95]
    torch.manual_seed(5)
    before = torch.rand(3)
    for make in (lambda seed: hf_generate_fn(model, 0, [2], batch_size=2, temperature=1.0, seed=seed),
                 lambda seed: engine_generate_fn(model, [2], batch_size=2, temperature=1.0, seed=seed)):
        torch.manual_seed(5)
        outs = make(0)([prompt] * 4, 12)  # one prompt four times: two batches of two rows
        assert torch.equal(torch.rand(3), before)  # the caller's generator did not move
        assert len({tuple(o) for o in outs}) == 4  # no two rows drew the same stream
        assert make(0)([prompt] * 4, 12) == outs  # the same seed: the same samples
        assert not set(map(tuple, make(1)([prompt] * 4, 12))) & set(map(tuple, outs))  # seed 1 shares none
        assert make(3).temperature == 1.0 and make(3).seed == 3


def test_regen_batches_bound_rows_and_positions_in_few_batch_sizes():
    from outrider.train.data.regenerate import ROW_STEP, regen_batches

    lengths = [300 + (7 * i) % 700 for i in range(2000)]  # prompts of 300-999 tokens, shuffled
    batches = regen_batches(lengths, 256, 128 * (1023 + 256), 256)
    assert sorted(i for b in batches for i in b) == list(range(2000))  # every prompt once
    flat = [i for b in batches for i in b]
    assert [lengths[i] for i in flat] == sorted(lengths)  # shortest first
    for b in batches:
        assert len(b) <= 256 and len(b) * (max(lengths[i] for i in b) + 256) <= 128 * (1023 + 256)
        assert len(b) % ROW_STEP == 0 or b is batches[-1]  # cut by positions: whole steps of rows
    assert len({len(b) for b in batches}) <= 256 // ROW_STEP + 1
    at, ordered = 0, sorted(lengths)
    for b in batches[:-1]:  # as large as the bounds allow: ROW_STEP more rows would not fit
        at += len(b)
        assert len(b) == 256 or (len(b) + ROW_STEP) * (ordered[at + ROW_STEP - 1] + 256) > 128 * (1023 + 256)
    assert len(batches[0]) == 224 and len(batches[-2]) == 128  # of the shortest prompts; of the longest
    assert regen_batches([5, 3, 4], 2) == [[1, 2], [0]]  # no position bound: batch_size rows
    assert regen_batches([900, 10], 4, 100, 50) == [[1], [0]]  # a prompt past the bound still goes, alone


def test_engine_generate_fn_keeps_batches_within_positions_and_halves_a_batch_out_of_memory(monkeypatch):
    from outrider.decode.engine import SpecEngine
    from outrider.demo import engine_generate_fn

    model = make_tiny("llama", 1)
    prompts = [[3, 94] + [7 + j for j in range(n)] + [2, 3, 95] for n in (1, 9, 2, 14, 3)]
    single = [engine_generate_fn(model, [2], batch_size=1)([p], 6)[0] for p in prompts]
    real, seen, released = SpecEngine.generate, [], []

    def tracked(self, batch, max_new_tokens, k=None):
        seen.append(len(batch) * (max(map(len, batch)) + max_new_tokens))
        if len(batch) > 2:  # a device that holds two rows at most
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, batch, max_new_tokens, k)

    monkeypatch.setattr(SpecEngine, "generate", tracked)
    monkeypatch.setattr(SpecEngine, "release", lambda self: released.append(1))
    fn = engine_generate_fn(model, [2], batch_size=4, max_batch_tokens=3 * (8 + 6))
    assert fn(prompts, 6) == single  # each reply as its prompt alone gets it, in the order asked
    # shortest first: three prompts of up to 8 tokens fit 42 positions, the two longer ones go alone;
    # the first batch (3 rows) fails, and its halves (1 row, 2 rows) run
    assert seen == [3 * (8 + 6), 1 * (6 + 6), 2 * (8 + 6), 14 + 6, 19 + 6]
    assert fn.splits == 1 and released == [1]
    fn = engine_generate_fn(model, [2], batch_size=4)  # no position limit: four rows (which fail, then
    seen.clear()                                         # run as two and two), then one
    assert fn(prompts, 6) == single and fn.splits == 1 and len(seen) == 1 + 2 + 1
    monkeypatch.setattr(SpecEngine, "generate", lambda self, batch, n, k=None: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory (simulated)")))
    with pytest.raises(torch.OutOfMemoryError):  # one prompt that does not fit: nothing to halve
        engine_generate_fn(model, [2], batch_size=1)([prompts[0]], 6)


def test_hf_generate_fn_batches_match_single_prompts():
    model = make_tiny("llama", 1)
    fn = hf_generate_fn(model, pad_token_id=0, end_ids=[2], batch_size=3)
    prompts = [[3, 94, 7, 8, 2, 3, 95], [3, 94, 9, 2, 3, 95], [3, 94, 10, 11, 12, 13, 2, 3, 95], [3, 94, 14, 2, 3, 95]]
    batched = fn(prompts, 5)
    single = [hf_generate_fn(model, 0, [2], batch_size=1)([p], 5)[0] for p in prompts]
    assert batched == single and all(1 <= len(x) <= 5 for x in batched)


# ------------------------------------------------------------------------------------ the real default


@pytest.mark.slow
def test_sharegpt_with_the_real_smollm2_tokenizer(tmp_path):
    if not (assets.default_model_dir() / "config.json").exists() or not assets.sharegpt_path().exists():
        pytest.skip("default model or ShareGPT not pulled (run `outrider pull`)")
    from outrider.models import load_tokenizer

    report = build_dataset("default", "sharegpt", str(tmp_path / "out"), max_conversations=20, max_length=1024,
                           eval_fraction=0.1, progress=False)
    assert report.kept >= 15 and report.heldout_excluded >= 0
    tok = load_tokenizer("default")
    records = {r["id"]: r for r in sharegpt.load_sharegpt(assets.sharegpt_path(pulled=True)).conversations[:400]}
    checked = 0
    for split in ("train", "eval"):
        ds = load_dataset(tmp_path / "out", split)
        for i, cid in enumerate(ds.conv_ids):
            ids, mask = (x.tolist() for x in ds[i])
            replies = [m["content"] + tok.eos_token for m in normalise_record(records[cid]) if m["role"] == "assistant"]
            runs, run = [], []
            for t, m in zip(ids, mask):
                if m:
                    run.append(t)
                elif run:
                    runs.append(run)
                    run = []
            cut = bool(run) and len(ids) == 1024
            if run:
                runs.append(run)
            assert 1 <= len(runs) <= len(replies)
            for k, r in enumerate(runs):
                text = tok.decode(r)
                if cut and k == len(runs) - 1:
                    assert replies[k].startswith(text.rstrip("\ufffd"))
                else:
                    assert text == replies[k]
            checked += 1
    assert checked == report.kept


def test_token_budget_batches_fill_the_budget_with_few_shapes():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(20, 400, 900), rng.integers(900, 1400, 60)])  # some over the cap
    ids = [np.arange(n, dtype=np.int32) for n in lengths]
    ds = TokenDataset(ids, [np.ones(n, dtype=np.int8) for n in lengths], [str(i) for i in range(len(ids))], {})
    cap, budget, multiple = 1024, 8192, 64

    def padded(b):
        return len(b) * int(-(-np.minimum(lengths[b], cap).max() // multiple) * multiple)

    for world in (1, 2):
        plan = ds.global_batches(1, seed=4, epoch=1, group_by_length=8, tokens=budget * world, cap=cap,
                                 multiple=multiple, world_size=world)
        flat = np.concatenate(plan)
        assert sorted(flat.tolist()) == list(range(len(ds)))  # every example once (none dropped here)
        assert all(padded(b) <= budget * world for b in plan)
        assert all(len(b) % world == 0 for b in plan[:-1])
        counts = [len(b) for b in plan]
        assert all(n % (8 * world) == 0 for n in counts if n >= 8 * world)  # few distinct shapes
        full = sum(padded(b) for b in plan) / (budget * world * len(plan))
        assert full > 0.8, full  # length-sorted windows fill the budget
        assert [b.tolist() for b in plan] == [b.tolist() for b in ds.global_batches(
            1, seed=4, epoch=1, group_by_length=8, tokens=budget * world, cap=cap, multiple=multiple,
            world_size=world)]
    by_count = ds.global_batches(16, seed=4, epoch=1, group_by_length=8)
    by_tokens = ds.global_batches(16, seed=4, epoch=1, group_by_length=8, tokens=budget, cap=cap, multiple=multiple)
    assert len(by_tokens) < len(by_count) and max(map(len, by_tokens)) > 16  # short sequences: more per batch
    ranks = [list(ds.batches(1, seed=4, rank=r, world_size=2, group_by_length=8, batch_tokens=budget, cap=cap,
                             pad_to_multiple_of=multiple)) for r in range(2)]
    single = ds.global_batches(2, seed=4, group_by_length=8, tokens=2 * budget, cap=cap, multiple=multiple,
                               world_size=2)
    assert len(ranks[0]) == len(ranks[1]) == len(single)
    for step, b in enumerate(single):
        assert sorted(ranks[0][step].indices.tolist() + ranks[1][step].indices.tolist()) == sorted(b.tolist())


def test_a_token_floor_joins_neighbouring_short_batches_only():
    rng = np.random.default_rng(1)
    lengths = np.concatenate([rng.integers(20, 120, 600), rng.integers(300, 1400, 200)])  # many short ones
    ids = [np.arange(n, dtype=np.int32) for n in lengths]
    ds = TokenDataset(ids, [np.ones(n, dtype=np.int8) for n in lengths], [str(i) for i in range(len(ids))], {})
    cap, floor, multiple, g = 1024, 4096, 64, 16

    def padded(b):  # the trainer's micro-batch: collated with padding, then cut at the cap
        rows, width = ds.collate(b, multiple).input_ids.shape
        return rows * min(width, -(-cap // multiple) * multiple)

    by_count = ds.global_batches(g, seed=2, epoch=3, group_by_length=8, cap=cap, multiple=multiple)
    joined = ds.global_batches(g, seed=2, epoch=3, group_by_length=8, cap=cap, multiple=multiple, min_tokens=floor)
    assert sorted(np.concatenate(joined).tolist()) == sorted(np.concatenate(by_count).tolist())
    assert all(len(b) % g == 0 for b in joined)  # unions of whole batches: ranks still split them evenly
    assert all(padded(b) <= 2 * floor or len(b) == g for b in joined)
    small_before = sum(padded(b) < floor for b in by_count)
    small_after = sum(padded(b) < floor for b in joined)
    assert small_before > 20 and small_after < small_before / 4 and len(joined) < len(by_count)
    assert {tuple(b.tolist()) for b in joined if padded(b) >= floor and len(b) == g} >= \
        {tuple(b.tolist()) for b in by_count if padded(b) >= floor}  # a batch at the floor is never touched
    assert [b.tolist() for b in joined] == [b.tolist() for b in ds.global_batches(
        g, seed=2, epoch=3, group_by_length=8, cap=cap, multiple=multiple, min_tokens=floor)]
    assert [b.tolist() for b in ds.global_batches(g, seed=2, epoch=3, cap=cap, multiple=multiple, min_tokens=floor)] \
        == [b.tolist() for b in ds.global_batches(g, seed=2, epoch=3, cap=cap, multiple=multiple)]  # ungrouped: as is


def test_repeated_conversations_under_other_ids_are_kept_once(tmp_path, target):
    convs = many_conversations(30)
    records = [sharegpt_record(c, t) for c, t in convs] + [sharegpt_record(f"copy-{c}", t) for c, t in convs[:6]]
    rep = build_dataset(target, write_json(tmp_path / "d.json", records), str(tmp_path / "out"), eval_fraction=0.3,
                        progress=False)
    assert rep.kept == 30 and rep.dropped.get("duplicate") == 6
    train, held = (load_dataset(tmp_path / "out", s) for s in ("train", "eval"))
    keys = [{x.tobytes() for x in ds.input_ids} for ds in (train, held)]
    assert not keys[0] & keys[1] and len(keys[0]) == len(train) and len(keys[1]) == len(held)
