"""The OpenAI-compatible endpoint client and `--regenerate --server`, against a real loopback server.

The server is ``http.server`` on 127.0.0.1 (random port, its own thread, shut down at the end)
answering ``/v1/models`` and ``/v1/chat/completions`` with a tiny random Llama, greedy. It
serves a bounded number of requests and answers 503 after that, so a client bug cannot loop.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from tiny import make_tiny, save_tiny, tiny_tokenizer

from outrider.errors import UserError
from outrider.train.data.datasets import load_dataset, read_manifest
from outrider.interop.openai_client import ChatClient, ServerRejected
from outrider.train.data.prepare import build_dataset
from outrider.train.data.regenerate import cache_path_for, hf_generate_fn

MODEL_NAME = "tiny-llama"
REJECT_WORD = "w60"  # a user turn with this word gets HTTP 400, like a prompt over the context length


class TinyServer:
    def __init__(self, model, tokenizer, max_requests: int = 200):
        self.model, self.tokenizer = model, tokenizer
        self.max_requests = max_requests
        self.requests = 0
        self.chat_requests: list[list[dict]] = []
        self.bodies: list[dict] = []  # every chat request's body (this server itself answers greedily)
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, obj):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def admitted(self):
                with server.lock:
                    server.requests += 1
                    if server.requests > server.max_requests:
                        self.reply(503, {"error": "request budget of the test server used up"})
                        return False
                return True

            def do_GET(self):
                if not self.admitted():
                    return
                if self.path == "/v1/models":
                    self.reply(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})
                else:
                    self.reply(404, {"error": "not found"})

            def do_POST(self):
                if not self.admitted():
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions" or body.get("model") != MODEL_NAME:
                    self.reply(404, {"error": f"no route {self.path} for model {body.get('model')}"})
                    return
                messages = body["messages"]
                if any(REJECT_WORD in m["content"].split() for m in messages if m["role"] == "user"):
                    self.reply(400, {"error": "prompt too long"})
                    return
                with server.lock:
                    server.chat_requests.append(messages)
                    server.bodies.append(body)
                    text = server.complete(messages, int(body["max_tokens"]))
                self.reply(200, {"object": "chat.completion", "model": MODEL_NAME,
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": text}}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def complete(self, messages, max_tokens):
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=0, eos_token_id=self.tokenizer.eos_token_id)
        new = out[0, len(prompt):].tolist()
        if self.tokenizer.eos_token_id in new:
            new = new[: new.index(self.tokenizer.eos_token_id)]
        return self.tokenizer.decode(new, skip_special_tokens=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama", 0)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(save_tiny("llama", tmp_path_factory.mktemp("target"), seed=0))


def conversations(n):
    out = []
    for k in range(n):
        turns = [{"from": "system", "value": "w5"}] if k % 2 else []
        for j in range(1 + k % 3):
            turns += [{"from": "human", "value": f"w{10 + (k * 7 + j) % 40} w{20 + k % 30}"},
                      {"from": "gpt", "value": f"w{50 + k % 9}"}]
        out.append({"id": f"s{k}", "conversations": turns})
    return out


def write(tmp_path, records):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    return str(path)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_chat_is_the_models_greedy_reply(model):
    tok = tiny_tokenizer()
    with TinyServer(model, tok) as srv:
        client = ChatClient(srv.url + "/v1/", retries=1)
        assert client.check() == MODEL_NAME
        messages = [{"role": "user", "content": "w7 w8 w9"}]
        text = client.chat(messages, 8)
        assert text == srv.complete(messages, 8) and text.strip()
        with pytest.raises(UserError, match="fix --server-model"):
            ChatClient(srv.url, model="no-such-model", retries=1).check()
        with pytest.raises(ServerRejected) as e:
            client.chat([{"role": "user", "content": REJECT_WORD}], 8)
        assert e.value.status == 400


def test_unreachable_server_is_a_user_error(tmp_path, target):
    port = free_port()
    with pytest.raises(UserError, match="cannot reach the server"):
        ChatClient(f"http://127.0.0.1:{port}", retries=1, timeout=2).check()
    with pytest.raises(UserError, match="cannot reach the server"):
        build_dataset(target, write(tmp_path, conversations(2)), str(tmp_path / "out"), regenerate=True,
                      server=f"http://127.0.0.1:{port}", progress=False)
    with pytest.raises(UserError, match="http"):
        ChatClient("127.0.0.1:8000")
    assert not (tmp_path / "out").exists()


def test_regenerate_through_the_server_equals_local_generation(tmp_path, model, target):
    tok = tiny_tokenizer()
    records = conversations(10)
    first_user = next(t for t in records[3]["conversations"] if t["from"] == "human")
    first_user["value"] = f"w11 {REJECT_WORD}"  # rejected at its first turn: dropped
    src = write(tmp_path, records)
    with TinyServer(model, tok) as srv:
        report = build_dataset(target, src, str(tmp_path / "srv"), regenerate=True, server=srv.url,
                               concurrency=4, max_new_tokens=6, eval_fraction=0.0, progress=False, retries=2,
                               backoff=0.01)
        served = len(srv.chat_requests)
        sampled = build_dataset(target, src, str(tmp_path / "hot"), regenerate=True, server=srv.url,
                                max_new_tokens=6, temperature=0.7, eval_fraction=0.0, progress=False)
    greedy_bodies, hot_bodies = srv.bodies[:served], srv.bodies[served:]
    assert all(b["temperature"] == 0.0 and "seed" not in b and "top_p" not in b for b in greedy_bodies)
    assert all(b["temperature"] == 0.7 and b["top_p"] == 1.0 for b in hot_bodies)
    assert len({b["seed"] for b in hot_bodies}) == len(hot_bodies) == served  # a seed per request
    assert sampled.regenerated == 9  # no greedy reply served it
    assert read_manifest(tmp_path / "hot")["regenerate"]["temperature"] == 0.7
    assert report.regenerated == 9 and report.dropped == {"server_rejected": 1}
    assert served == sum(1 + k % 3 for k in range(10) if k != 3)  # every reply of every kept conversation
    local = build_dataset(target, src, str(tmp_path / "local"), regenerate=True, max_new_tokens=6,
                          eval_fraction=0.0, progress=False,
                          generate_fn=hf_generate_fn(model, pad_token_id=0, end_ids=[2], batch_size=1))
    assert local.dropped == {}
    a, b = load_dataset(tmp_path / "srv"), load_dataset(tmp_path / "local")
    b_by_id = {c: i for i, c in enumerate(b.conv_ids)}
    for i, cid in enumerate(a.conv_ids):
        assert a[i][0].tolist() == b[b_by_id[cid]][0].tolist()
        assert a[i][1].tolist() == b[b_by_id[cid]][1].tolist()
    original = {r["id"]: [t["value"] for t in r["conversations"] if t["from"] == "gpt"] for r in records}
    ids, mask = a[0]
    assert tok.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if m], skip_special_tokens=True) != \
        " ".join(original[a.conv_ids[0]])  # the replies are the target's, not the dataset's


def test_interrupted_run_resumes_from_the_cache(tmp_path, model, target):
    tok = tiny_tokenizer()
    src = write(tmp_path, conversations(12))
    total_turns = sum(1 + k % 3 for k in range(12))
    out = tmp_path / "out"
    with TinyServer(model, tok, max_requests=1 + 10) as srv:  # /v1/models + 10 replies, then 503s
        with pytest.raises(UserError, match="rerun"):
            build_dataset(target, src, str(out), regenerate=True, server=srv.url, concurrency=2,
                          max_new_tokens=5, eval_fraction=0.0, progress=False, retries=2, backoff=0.01)
    assert not out.exists()
    cached = [json.loads(line) for line in cache_path_for(out).read_text().splitlines()]
    assert 0 < len(cached) < 12
    done_turns = sum(len(c["responses"]) for c in cached)
    with TinyServer(model, tok) as srv:
        report = build_dataset(target, src, str(out), regenerate=True, server=srv.url, concurrency=2,
                               max_new_tokens=5, eval_fraction=0.0, progress=False, retries=2, backoff=0.01)
        resumed_turns = len(srv.chat_requests)
        asked = {next(m["content"] for m in msgs if m["role"] == "user") for msgs in srv.chat_requests}
    finished_ids = {c["conv_id"] for c in cached}
    openers = {r["id"]: next(t["value"] for t in r["conversations"] if t["from"] == "human")
               for r in conversations(12)}
    assert len(set(openers.values())) == 12 and not asked & {openers[c] for c in finished_ids}
    assert report.from_cache == len(cached) and report.regenerated == 12
    assert resumed_turns == total_turns - done_turns  # finished conversations were not asked again
    with TinyServer(model, tok) as srv:
        fresh = build_dataset(target, src, str(tmp_path / "fresh"), regenerate=True, server=srv.url,
                              concurrency=3, max_new_tokens=5, eval_fraction=0.0, progress=False)
    a, b = load_dataset(out), load_dataset(tmp_path / "fresh")
    assert fresh.from_cache == 0 and sorted(a.conv_ids) == sorted(b.conv_ids)
    for i, cid in enumerate(a.conv_ids):
        assert a[i][0].tolist() == b[b.conv_ids.index(cid)][0].tolist()
    assert finished_ids <= set(a.conv_ids)
