"""`bench --server` against a loopback fake engine: vLLM's counters read around each level, the
faults (unreachable, HTTP errors, an unserved model, a stalled stream) as one line and exit 2 with
the finished levels kept, the metrics parsers on each engine's exposition format, `--compare`,
and the served records feeding `plan --measured`.

The fake engine is ``http.server`` on 127.0.0.1 (its own port and thread, shut down at the end): it
streams ``max_tokens`` chunks per chat request and exposes vLLM's speculative counters, which
advance by known amounts per request; it answers at most ``budget`` requests (then 503), so a
client bug cannot loop.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from outrider.cli import main
from outrider.bench.served.metrics import NO_COUNTERS, acceptance, engine_of, parse_exposition

# vLLM's exposition as prometheus_client writes SpecDecodingProm's counters (vllm/v1/spec_decode/metrics.py)
VLLM_TEXT = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}
vllm:spec_decode_num_drafts_created{{engine="0",model_name="m"}} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {draft_tokens}
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p1}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="2"}} {p2}
vllm:num_requests_running{{engine="0",model_name="m"}} 0.0
"""

# SGLang's SchedulerMetricsCollector gauges (python/sglang/srt/metrics/collector.py), one per TP rank
SGLANG_TEXT = """# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"}} {a}
sglang:spec_accept_length{{engine_type="unified",model_name="m",pp_rank="0",tp_rank="1"}} {b}
# HELP sglang:spec_accept_rate The average acceptance rate of speculative decoding.
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"}} 0.5
"""


def vllm_text(drafts, accepted, per_pos, k=3):
    return VLLM_TEXT.format(drafts=float(drafts), draft_tokens=float(k * drafts), accepted=float(accepted),
                            p0=float(per_pos[0]), p1=float(per_pos[1]), p2=float(per_pos[2]))


def test_vllm_counters_give_tau_and_rates_over_the_level():
    before = parse_exposition(vllm_text(100, 150, (80, 50, 20)))
    after = parse_exposition(vllm_text(300, 450, (240, 150, 60)))
    assert engine_of(after) == "vllm"
    got = acceptance("vllm", before, after)
    assert got.tau == pytest.approx(1 + 300 / 200) and got.k == 3
    assert got.accept_rate_per_pos == pytest.approx([160 / 200, 100 / 200, 40 / 200])
    assert got.draft_tokens == pytest.approx(600)
    idle = acceptance("vllm", after, after)
    assert idle.tau is None and "did not move" in idle.source


def test_sglang_gauge_and_engines_without_counters():
    text = SGLANG_TEXT.format(a=2.5, b=2.7)
    samples = parse_exposition(text)
    assert engine_of(samples) == "sglang"
    got = acceptance("sglang", samples, samples, k=3)
    assert got.tau == pytest.approx(2.6) and got.k == 3 and got.accept_rate_per_pos == []
    off = acceptance("sglang", samples, parse_exposition(SGLANG_TEXT.format(a=0.0, b=0.0)))
    assert off.tau is None and off.source.startswith(NO_COUNTERS) and "off" in off.source
    plain_vllm = parse_exposition('vllm:num_requests_running{engine="0"} 1\n')
    assert acceptance("vllm", plain_vllm, plain_vllm).tau is None
    assert acceptance(None, None, None).source.startswith(NO_COUNTERS)
    other = parse_exposition("http_requests_total 5\n")
    assert engine_of(other) is None and acceptance(None, other, other).tau is None


def test_exposition_parser_reads_the_format():
    text = ('# a comment\nm_total{a="x\\"y",b="1"} 3.5 1700000000000\nm_total{a="z"} NaN\n'
            'g +Inf\nbroken{a="1" 2\nm_created 5\n')
    s = parse_exposition(text)
    assert [(x.name, dict(x.labels)) for x in s[:2]] == [("m_total", {"a": 'x"y', "b": "1"}), ("m_total", {"a": "z"})]
    assert s[0].value == 3.5 and s[2].value == float("inf") and len(s) == 3


class FakeEngine:
    """A streaming OpenAI-compatible server with vLLM's speculative counters (see the module docstring)."""

    def __init__(self, model="fake-model", metrics=True, fail_from=None, stall_s=0.0, budget=200, accept=(3, 2, 1),
                 hang_up_from=None):
        self.model, self.metrics, self.fail_from, self.stall_s, self.budget = model, metrics, fail_from, stall_s, budget
        self.hang_up_from = hang_up_from  # from this chat request on, close the connection without a reply
        self.accept = accept  # per request: tokens accepted at draft positions 0..2 over its 4 drafts
        self.chats = 0
        self.counters = {"drafts": 0, "accepted": 0, "pos": [0, 0, 0]}
        self.lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send(self, status, body: bytes, kind="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self.send(200, json.dumps({"data": [{"id": engine.model}]}).encode())
                elif self.path == "/metrics" and engine.metrics:
                    c = engine.counters
                    self.send(200, vllm_text(c["drafts"], c["accepted"], c["pos"]).encode(), "text/plain")
                elif self.path == "/version" and engine.metrics:
                    self.send(200, b'{"version": "0.0-fake"}')
                else:
                    self.send(404, b'{"detail": "Not Found"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with engine.lock:
                    engine.chats += 1
                    n = engine.chats
                if engine.hang_up_from is not None and n >= engine.hang_up_from:
                    self.close_connection = True
                    return
                if n > engine.budget or (engine.fail_from is not None and n >= engine.fail_from):
                    self.send(500, b'{"error": "engine crashed"}')
                    return
                if body.get("model") != engine.model:
                    self.send(404, json.dumps({"error": f"model {body.get('model')} not found"}).encode())
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                words = body["messages"][-1]["content"].split()
                for i in range(body["max_tokens"]):
                    chunk = {"choices": [{"index": 0, "delta": {"content": f" {words[i % len(words)]}"}}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    if engine.stall_s and i == 0:
                        time.sleep(engine.stall_s)
                        return
                    time.sleep(0.002)
                end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
                usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"], "prompt_tokens": 7}}
                self.wfile.write(f"data: {json.dumps(end)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
                with engine.lock:  # per request 4 drafts (by default accepting 3, 2, 1 and 0 tokens)
                    c = engine.counters
                    c["drafts"] += 4
                    c["accepted"] += sum(engine.accept)
                    c["pos"] = [p + a for p, a in zip(c["pos"], engine.accept)]

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("alpha beta gamma\ndelta epsilon\nzeta eta theta iota\n")
    return str(p)


def _bench(url, prompts, tmp_path, *extra):
    out = tmp_path / "served.json"
    rc = main(["bench", "--server", url, "--prompts", prompts, "--max-new-tokens", "6", "--quiet",
               "--json", str(out), *extra])
    return rc, out


def test_vllm_counters_end_to_end(prompts, tmp_path, capsys):
    with FakeEngine() as engine:
        rc, out = _bench(engine.url, prompts, tmp_path, "--concurrency", "1,2", "--method", "eagle3")
    assert rc == 0
    records = json.loads(out.read_text())
    assert [(r["concurrency"], r["max_in_flight"]) for r in records] == [(1, 1), (2, 2)]
    for r in records:  # 3 requests a level, each 4 drafts accepting 6 tokens: tau = 1 + 18 / 12
        assert r["engine"] == "vllm" and r["engine_version"] == "0.0-fake" and r["method"] == "eagle3"
        assert r["tau"] == pytest.approx(2.5) and r["k"] == 3
        assert r["accept_rate_per_pos"] == pytest.approx([0.75, 0.5, 0.25])
        assert r["completed"] == 3 and r["new_tokens"] == 18 and r["tokens_counted_from"] == ["usage"]
        assert r["outputs"][0] == " alpha beta gamma alpha beta gamma"
        assert r["itl_ms_p50"] > 0 and r["ttft_ms_p50"] > 0 and r["tokens_per_s"] > 0
        assert r["verify_step_ms"] == pytest.approx(r["tpot_ms"] * 2.5)
    assert "outrider bench --server" in capsys.readouterr().out


def _one_line(capsys):
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("outrider bench: error:"), err
    return err[0]


def test_unreachable_server_is_one_line(prompts, tmp_path, capsys):
    with FakeEngine() as engine:
        url = engine.url
    rc, out = _bench(url, prompts, tmp_path)
    assert rc == 2 and "cannot reach the server" in _one_line(capsys) and not out.exists()


def test_unserved_model_is_one_line(prompts, tmp_path, capsys):
    with FakeEngine() as engine:
        rc, _ = _bench(engine.url, prompts, tmp_path, "--server-model", "other-model")
    line = _one_line(capsys)
    assert rc == 2 and "serves fake-model, not 'other-model'" in line


def test_server_errors_keep_the_finished_levels(prompts, tmp_path, capsys):
    with FakeEngine(fail_from=4) as engine:  # the first level's 3 requests pass, the second's fail
        rc, out = _bench(engine.url, prompts, tmp_path, "--concurrency", "1,2,4")
    line = _one_line(capsys)
    assert rc == 2 and "3 of 3 requests failed at concurrency 2" in line and "HTTP 500" in line
    assert str(out) in line
    records = json.loads(out.read_text())
    assert [(r["concurrency"], r["completed"], r["failed"]) for r in records] == [(1, 3, 0), (2, 0, 3)]
    assert records[0]["tau"] == pytest.approx(2.5)


def test_connections_dropped_mid_run_keep_the_finished_levels(prompts, tmp_path, capsys):
    with FakeEngine(hang_up_from=4) as engine:
        rc, out = _bench(engine.url, prompts, tmp_path, "--concurrency", "1,2")
    line = _one_line(capsys)
    assert rc == 2 and "connection failed" in line
    assert [r["completed"] for r in json.loads(out.read_text())] == [3, 0]


def test_stalled_stream_ends_at_the_timeout(prompts, tmp_path, capsys):
    with FakeEngine(stall_s=4.0) as engine:
        t0 = time.monotonic()
        rc, out = _bench(engine.url, prompts, tmp_path, "--concurrency", "3", "--timeout", "0.5")
        elapsed = time.monotonic() - t0
    line = _one_line(capsys)
    assert rc == 2 and "stalled: no data for 0.5 s" in line
    assert elapsed < 3.5  # three concurrent requests, each ended by the 0.5 s timeout, not the 4 s stall
    assert json.loads(out.read_text())[0]["failed"] == 3


def test_baseline_compare_and_plan_read_the_records(prompts, tmp_path, capsys):
    with FakeEngine() as spec, FakeEngine(metrics=False) as plain:
        rc, out = _bench(spec.url, prompts, tmp_path, "--concurrency", "1,2", "--baseline-server", plain.url,
                         "--method", "eagle3")
        assert rc == 0
        rc = main(["bench", "--server", plain.url, "--prompts", prompts, "--max-new-tokens", "6", "--quiet",
                   "--concurrency", "1,2", "--json", str(tmp_path / "plain.json")])
        assert rc == 0
    records = json.loads(out.read_text())
    spec_recs = [r for r in records if r["role"] == "server"]
    base_recs = [r for r in records if r["role"] == "baseline"]
    assert len(spec_recs) == len(base_recs) == 2
    assert all(r["tau"] is None and r["acceptance"].startswith(NO_COUNTERS) and "ar_step_ms" in r for r in base_recs)
    for s, b in zip(spec_recs, base_recs):
        assert s["speedup_vs_baseline"] == pytest.approx(s["tokens_per_s"] / b["tokens_per_s"])
    capsys.readouterr()
    cmp_path = tmp_path / "cmp.json"
    assert main(["bench", "--compare", str(out), str(tmp_path / "plain.json"), "--json", str(cmp_path)]) == 0
    cmp = json.loads(cmp_path.read_text())
    assert all("speedup_vs_baseline" in r for r in cmp if r["role"] == "server")
    capsys.readouterr()
    rc = main(["plan", "default", "--hardware", "h100", "--measured", str(out), "--batch", "1,2", "--k", "3"])
    printed = capsys.readouterr().out
    assert rc == 0 and "batch 2" in printed and "served" in printed
    assert "eagle3" in printed and "measured" in printed
    rc = main(["plan", "default", "--hardware", "h100", "--calibrate", str(out), "--batch", "1", "--k", "3"])
    assert rc == 0 and "calibrated (served.json)" in capsys.readouterr().out


def test_flag_combinations_are_refused(prompts, capsys):
    assert main(["bench"]) == 2
    assert "needs a target T" in _one_line(capsys)
    assert main(["bench", "--baseline-server", "http://127.0.0.1:1", "--prompts", prompts]) == 2
    assert "needs --server" in _one_line(capsys)
    assert main(["bench", "default", "--method", "ngram", "--server-model", "m", "--prompts", prompts]) == 2
    assert "--server-model names a model on a served engine: it needs --server" in _one_line(capsys)
    assert main(["bench", "--server", "ftp://x", "--prompts", prompts]) == 2
    assert "http(s) URL" in _one_line(capsys)
