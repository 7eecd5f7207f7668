"""The engine capture's faults against a stand-in server (no vLLM needed): a connector file that holds
other tokens, is cut short, never appears, or a reply without its path: one line, exit 2, the
finished shards kept, and a rerun resumes (a full disk on our side too); the engine's files are
deleted as they are read."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_trainer import _conversations
from tiny import save_tiny

from outrider.cli import main
from outrider.train.data.prepare import build_dataset
from outrider.train.states.cache import OutriderCache
from outrider.train.states.engine_source import engine_layer_ids, extraction_args

AUX = (1, 2, 3)
LAYERS = 4
H = 64


class FakeExtractor:
    """Answers /v1/completions as vLLM's extract_hidden_states does, writing the file itself;
    ``mode`` breaks it after ``good`` requests: mismatch, truncated, missing, no-path."""

    def __init__(self, storage: Path, mode: str = "good", good: int = 0):
        self.storage, self.mode, self.good, self.count = storage, mode, good, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send({"data": [{"id": "fake"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._send(outer.answer(body["prompt"]))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, ids: list[int]) -> dict:
        self.count += 1
        mode = "good" if self.count <= self.good else self.mode
        path = self.storage / f"req-{self.count}.safetensors"
        if mode == "no-path":
            return {"choices": [{"text": "x"}]}
        tokens = torch.tensor(ids if mode != "mismatch" else [ids[0] + 1] + ids[1:])
        g = torch.Generator().manual_seed(sum(ids))
        states = torch.randn(len(ids), len(AUX) + 1, H, generator=g)  # [T, 4, H]
        if mode != "missing":
            save_file({"hidden_states": states, "token_ids": tokens}, str(path))
            if mode == "truncated":
                path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return {"choices": [{"text": "x"}], "kv_transfer_params": {"hidden_states_path": f"/elsewhere/{path.name}"}}

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_source")
    target = save_tiny("llama", root / "target", layers=LAYERS)
    data = root / "data"
    build_dataset(str(target), str(_conversations(root / "c.json", 12, 2, 5, 60)), str(data), eval_fraction=0.2,
                  progress=False)
    return target, data


def _capture(setup, server: str, storage: Path, out: Path) -> int:
    target, data = setup
    return main(["capture", str(target), "--data", str(data), "--out", str(out), "--dtype", "float32", "--aux-layers",
                 "1,2,3", "--max-tokens-per-shard", "200", "--engine", "vllm", "--server", server,
                 "--engine-storage", str(storage), "--timeout", "2", "--quiet"])


def test_extraction_asks_for_the_aux_ids_and_the_last_layer():
    assert engine_layer_ids(AUX, LAYERS) == [1, 2, 3, 4]
    args = extraction_args("t", AUX, LAYERS, "/s", cpu=True)
    spec, kv = json.loads(args[1]), json.loads(args[3])
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3, 4]
    assert kv["kv_connector_module_path"] == "outrider.interop.vllm_connector" and kv["kv_role"] == "kv_producer"
    assert json.loads(extraction_args("t", AUX, LAYERS, "/s")[3])["kv_connector"] == "ExampleHiddenStatesConnector"


@pytest.mark.parametrize("mode, says", [("mismatch", "holds other tokens than the request"),
                                        ("truncated", "cannot read the hidden states"),
                                        ("missing", "did not appear within"),
                                        ("no-path", "gave no hidden_states_path")])
def test_a_broken_reply_is_one_line_and_a_rerun_resumes(setup, tmp_path, capsys, mode, says):
    storage, out = tmp_path / "hs", tmp_path / "cache"
    storage.mkdir()
    with FakeExtractor(storage, mode, good=4) as fake:
        assert _capture(setup, fake.url, storage, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and manifest["shards"]  # the first shard's examples came back whole
    with FakeExtractor(storage) as fake:
        assert _capture(setup, fake.url, storage, out) == 0
    assert json.loads((out / "manifest.json").read_text())["complete"]
    cache = OutriderCache(str(out))
    ids, _, _ = cache.examples("train")
    st = cache.read("train", 0)
    g = torch.Generator().manual_seed(int(ids[0].sum()))
    assert torch.equal(st.aux[:, 0], torch.randn(len(ids[0]), len(AUX) + 1, H, generator=g)[:, 0])
    assert not [p for p in storage.iterdir() if ".safetensors" in p.name]


def test_flags_that_need_the_engine_or_a_storage_folder(setup, tmp_path, capsys):
    target, data = setup
    for extra, says in ((["--server", "http://x"], "go with --engine vllm"),
                        (["--engine", "vllm", "--server", "http://127.0.0.1:9"], "needs --engine-storage"),
                        (["--engine", "vllm", "--stream-layers"], "leave out --stream-layers")):
        assert main(["capture", str(target), "--data", str(data), "--out", str(tmp_path / "c"), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert main(["capture", str(target), "--data", str(data), "--out", str(tmp_path / "c"), "--engine", "vllm",
                 "--aux-layers", "1,2,3", "--print-command"]) == 0
    printed = capsys.readouterr().out
    assert f"vllm serve {target} --speculative-config" in printed and "[1, 2, 3, 4]" in printed
    assert printed.startswith("PYTHONPATH=") and "SyncHiddenStatesConnector" in printed  # no CUDA here
    assert not (tmp_path / "c").exists()  # printing the command writes nothing


def test_a_full_disk_keeps_the_finished_shards_and_the_rerun_resumes(setup, tmp_path, capsys, monkeypatch):
    import errno

    from outrider.train.states import cache as cache_mod

    write, calls = cache_mod._write_file, []

    def full(path, blob):
        calls.append(path)
        if len(calls) == 2:  # the second shard's file: half written, then the disk is full
            with open(path, "wb") as f:
                f.write(blob[: len(blob) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, blob)

    storage, out = tmp_path / "hs", tmp_path / "cache"
    storage.mkdir()
    monkeypatch.setattr(cache_mod, "_write_file", full)
    with FakeExtractor(storage) as fake:
        assert _capture(setup, fake.url, storage, out) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "disk is full" in err[0], err
        monkeypatch.setattr(cache_mod, "_write_file", write)
        assert _capture(setup, fake.url, storage, out) == 0
    assert json.loads((out / "manifest.json").read_text())["complete"]
    assert not [p for p in storage.iterdir() if ".safetensors" in p.name]
