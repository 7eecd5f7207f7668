"""Served vs offline: the head's walked tau here against the engine's counters, with inspect's
findings for a broken export; and `bench --server` against a real `transformers serve` of the
default model, whose greedy outputs must equal ours.

The head whose walked tau is known: a tiny Llama whose decoder layers add nothing (``o_proj`` and
``down_proj`` zero), so its hidden states are the token's embedding and its greedy next token is
``P(x)`` for a fixed permutation ``P`` (``lm_head`` rows are embeddings); the head also adds
nothing in its layer, fuses one aux state and predicts ``P(P(x))`` from the state of ``x``: the
first draft is always right, the later ones almost never, so its walked tau is about 2.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_served import FakeEngine, vllm_text
from tiny import VOCAB, make_tiny, tiny_tokenizer

from outrider.cli import main
from outrider.interop import inspect as compat
from outrider.heads.eagle3 import Eagle3Config, Eagle3Head
from outrider.interop.formats.export import save_head
from outrider.bench.served import offline
from outrider.bench.served.metrics import acceptance, parse_exposition
from outrider.interop.server_process import ServerFailed, ServerProcess

LAYERS = 8
AUX = (2, 4, 5)
PROMPTS = ["w10 w11 w12", "w40 w41", "w70 w71 w72 w73"]


def _permutation() -> list[int]:
    ids = list(range(5, VOCAB))  # one cycle over the words; the specials (pad: a zero embedding, EOS) stay put
    perm = list(range(VOCAB))
    for j, i in enumerate(ids):
        perm[i] = ids[(j + 1) % len(ids)]
    return perm


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_pair")
    model = make_tiny("llama", seed=3, layers=LAYERS)
    perm = _permutation()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight  # [vocab, hidden]
        for x in range(VOCAB):
            model.lm_head.weight[perm[x]] = 50 * emb[x]
    target = root / "target"
    model.save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    cfg = Eagle3Config.for_target(model.config, draft_vocab_size=VOCAB, aux_layer_ids=AUX)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        H = model.config.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, :H] = torch.eye(H)  # the first aux state: the token's embedding
        head.norm.weight.fill_(1.0)
        for x in range(VOCAB):
            head.lm_head.weight[perm[perm[x]]] = 50 * emb[x]
    head.set_vocab(torch.zeros(VOCAB, dtype=torch.long), torch.ones(VOCAB, dtype=torch.bool))
    good = root / "head"
    save_head(head.eval(), good, target=str(target))
    broken = root / "broken"  # vLLM reads the top-level ids: an export that hands it other layers
    shutil.copytree(good, broken)
    cfg_json = json.loads((broken / "config.json").read_text())
    cfg_json["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
    (broken / "config.json").write_text(json.dumps(cfg_json))
    return target, good, broken


def test_walked_tau_and_the_gap_verdicts(pair):
    target, good, broken = pair
    run = offline.local_run(str(target), PROMPTS, max_new_tokens=12, draft=str(good), k=3)
    assert 1.8 <= run.tau <= 2.2 and run.accept_rate_per_pos[0] > 0.9
    assert run.outputs == offline.local_run(str(target), PROMPTS, 12).outputs  # lossless: same greedy text
    close = acceptance("vllm", parse_exposition(vllm_text(0, 0, (0, 0, 0))),
                       parse_exposition(vllm_text(100, 92, (90, 2, 0))))
    checks_good = compat.inspect(str(target), str(good)).checks
    ok = offline.gap(close.tau, run.tau, checks_good, "vllm")
    assert not ok["flagged"] and "close to" in ok["verdict"]
    far = acceptance("vllm", parse_exposition(vllm_text(0, 0, (0, 0, 0))),
                     parse_exposition(vllm_text(100, 15, (12, 3, 0))))
    checks_broken = compat.inspect(str(target), str(broken)).checks
    flagged = offline.gap(far.tau, run.tau, checks_broken, "vllm")
    assert flagged["flagged"] and any(f.startswith("aux ids as read [vllm]: fail") for f in flagged["findings"])
    assert "far below" in flagged["verdict"] and "[1, 3, 4]" in flagged["verdict"]
    sglang = acceptance("sglang", [], parse_exposition(
        'sglang:spec_accept_length{tp_rank="0"} 1.1\n'), k=3)
    nothing = offline.gap(sglang.tau, run.tau, [], "sglang")
    assert nothing["flagged"] and nothing["check_by_hand"]  # no findings: the checks to run by hand


def test_cli_flags_a_served_head_far_below_its_walked_tau(pair, tmp_path, capsys):
    target, _, broken = pair
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "served.json"
    with FakeEngine(accept=(1, 0, 0)) as engine:  # tau 1.25 against the head's ~2
        rc = main(["bench", str(target), "--server", engine.url, "--draft", str(broken), "--prompts", str(prompts),
                   "--concurrency", "1", "--max-new-tokens", "12", "--k", "3", "--quiet", "--json", str(out)])
    assert rc == 0
    (r,) = json.loads(out.read_text())
    assert r["tau"] == pytest.approx(1.25) and r["method"] == "eagle3" and 1.8 <= r["offline_tau"] <= 2.2
    assert r["served_vs_offline"]["flagged"] and "FLAGGED" in capsys.readouterr().out


def test_transformers_serve_default_model(tmp_path, capsys):
    """A real OpenAI-compatible server: `transformers serve` of the default model on the CPU."""
    from outrider import assets

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    model_dir = assets.default_model_dir()
    cli = Path(sys.executable).parent / "transformers"
    if not (model_dir / "config.json").exists() or not cli.exists():
        pytest.skip("default model not pulled, or no `transformers` command next to this Python")
    server = ServerProcess([str(cli), "serve", str(model_dir), "--host", "127.0.0.1", "--port", "{port}", "--device",
                            "cpu", "--dtype", "float32", "--log-level", "warning"], log=tmp_path / "serve.log")
    with server:
        try:
            server.wait_ready(timeout=120)
        except ServerFailed as e:
            pytest.fail(f"transformers serve did not come up: {e.line}")
        url = server.url
        out = tmp_path / "served.json"
        rc = main(["bench", "default", "--server", url, "--concurrency", "1,4", "--num-prompts", "4",
                   "--max-new-tokens", "8", "--quiet", "--timeout", "120", "--json", str(out)])
        assert rc == 0
        records = json.loads(out.read_text())
        assert [r["concurrency"] for r in records] == [1, 4]
        for r in records:
            assert r["completed"] == 4 and r["acceptance"].startswith("no acceptance counters")
            assert r["outputs_equal_local"] == 4, r["output_differences"]
            assert r["tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0 and r["itl_ms_p99"] >= r["itl_ms_p50"] > 0
        assert "equal to ours on 4 of 4" in capsys.readouterr().out
