"""Peers' hidden-state caches as training input: SpecForge's per-example files and speculators'/vLLM's
hs_{i}.safetensors (plain and hs-connectors fp8), written with the peers' own code where it runs on a CPU;
training on them equals training on our own cache of the same states."""

from __future__ import annotations

import gzip
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_trainer import _conversations
from tiny import save_tiny

from outrider.cli import main as cli_main
from outrider.config import TrainConfig
from outrider.models import load_model
from outrider.train.data.datasets import load_dataset
from outrider.train.data.prepare import build_dataset
from outrider.train.loop.trainer import train
from outrider.train.options import TrainOptions
from outrider.train.states.cache_capture import capture_cache
from outrider.train.states.features import open_cache
from outrider.train.states.target_weights import TargetWeights

AUX = (1, 2, 3)
# batches by count in a seeded order: the plan does not depend on lengths (SpecForge's are padded)
CFG = TrainConfig(steps=5, batch_size=2, grad_accum=2, max_length=64, lr=3e-3, warmup_steps=1, ttt_steps=3,
                  draft_vocab_size=40, eval_every=5, save_every=5, log_every=1, group_by_length=0, aux_layer_ids=AUX)


def _import_or_skip(module: str, package: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        pytest.skip(f"{package} is not installed ({e}); CI installs it with pip install --no-deps {package}")


class ReplaySource:
    """A hidden-state source that hands back given states (the capture's source protocol)."""

    def __init__(self, states: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]], hidden_size: int):
        self.states_of, self.aux_layer_ids, self.hidden_size, self.pass_tokens = states, AUX, hidden_size, 10 ** 9

    def states(self, input_ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.states_of[tuple(ids)] for ids in input_ids]

    def __enter__(self) -> "ReplaySource":
        return self

    def __exit__(self, *exc) -> None:
        return None


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    target = save_tiny("llama", root / "tiny")
    data = root / "data"
    build_dataset(str(target), str(_conversations(root / "a.json", 24, 5, 5, 60)), str(data), eval_fraction=0.0,
                  progress=False)
    model, _ = load_model(str(target), device="cpu", dtype="float32", with_tokenizer=False)
    ds = load_dataset(data)
    pre: dict[str, torch.Tensor] = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, a: pre.__setitem__("x", a[0]))
    examples = []
    with torch.no_grad():
        for ids, mask in zip(ds.input_ids, ds.loss_mask):
            out = model(torch.as_tensor(ids.astype(np.int64))[None], output_hidden_states=True)
            aux = torch.stack([out.hidden_states[j][0] for j in AUX], 1)  # [T, 3, H]
            examples.append((ids.astype(np.int64), mask.astype(np.int64), aux, pre["x"][0], out.hidden_states[-1][0]))
    hook.remove()
    return {"root": root, "target": str(target), "data": str(data), "examples": examples}


def _ours(env, name: str, states: dict) -> str:
    out = env["root"] / name
    capture_cache(env["target"], env["data"], str(out), dtype="float32", aux_layer_ids=AUX, max_tokens_per_shard=400,
                  progress=False, source=ReplaySource(states, 64))
    return str(out)


def _train_losses(env, cache: str, name: str) -> list[float]:
    out = env["root"] / name
    train(TrainOptions(env["target"], None, str(out), config=CFG, progress=False, cache=cache))
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if r["type"] == "train"]


def _specforge(env, out: Path, batch: int = 4) -> Path:
    """SpecForge's writer: each batch right-padded with zeros to its longest row, one record per row
    (its capture layout's ``materialize``), ``torch.save``d plain or through gzip."""
    algorithms = _import_or_skip("specforge.algorithms.builtin", "specforge==0.2.0")
    layout = algorithms.builtin_algorithm_registry().resolve("eagle3").providers.offline_for("text").capture_layout
    examples = env["examples"]
    gen = torch.Generator().manual_seed(0)
    for start in range(0, len(examples), batch):
        group = examples[start:start + batch]
        width = max(len(e[0]) for e in group)
        for k, (ids, mask, aux, _, final) in enumerate(group):
            idx, T, pad = start + k, len(ids), width - len(ids)
            noise = torch.randn(pad, 4 * 64, generator=gen)  # states of the padding tokens: never read
            rec = layout.materialize({
                "input_ids": torch.cat([torch.as_tensor(ids), torch.zeros(pad, dtype=torch.long)]),
                "loss_mask": torch.cat([torch.as_tensor(mask), torch.zeros(pad, dtype=torch.long)]),
                "aux_hidden_states": torch.cat([aux.reshape(T, -1), noise[:, :192]])[None],
                "last_hidden_states": torch.cat([final, noise[:, 192:]])[None]})
            path = out / "rows_0-2000" / f"data_{idx}.ckpt{'.gz' if idx % 2 else ''}"
            path.parent.mkdir(parents=True, exist_ok=True)
            if idx % 2:
                with gzip.open(path, "wb", compresslevel=6) as f:
                    torch.save(dict(rec), f)
            else:
                torch.save(dict(rec), path)
    return out


def test_specforge_files_train_as_our_cache_does(env):
    store = _import_or_skip("specforge.runtime.data_plane.feature_store", "specforge==0.2.0")
    folder = _specforge(env, env["root"] / "specforge")
    raw = store.load_feature_file(str(folder / "rows_0-2000" / "data_1.ckpt.gz"))  # their reader reads them
    assert raw["aux_hidden_state"].shape[-1] == 192
    reader = open_cache(folder)
    assert reader.kind == "SpecForge" and reader.hidden_size == 64 and not reader.final_prenorm
    ids, masks, _ = reader.examples("train")
    for (want, mask, *_), got, m in zip(env["examples"], ids, masks):
        last = int(np.flatnonzero(mask)[-1]) + 1  # the padding (and the tail no loss reads) dropped
        assert np.array_equal(got, want[:last]) and np.array_equal(m, mask[:last])
    st = reader.read("train", 1)
    assert torch.equal(st.aux, env["examples"][1][2][:len(ids[1])])
    states = {tuple(e[0].tolist()): (e[2].reshape(len(e[0]), -1), e[4]) for e in env["examples"]}
    ours = _ours(env, "ours-specforge", states)
    a, b = _train_losses(env, str(folder), "t-specforge"), _train_losses(env, ours, "t-ours-specforge")
    assert len(a) == CFG.steps and np.allclose(a, b, rtol=1e-5, atol=0), (a, b)


def _stub_vllm(monkeypatch) -> None:
    """hs-connectors' fp8 connector subclasses a vLLM class; its writer needs nothing of it."""
    name = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
    parts = name.split(".")
    for k in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:k]), types.ModuleType(".".join(parts[:k])))
    sys.modules[name].ExampleHiddenStatesConnector = type("ExampleHiddenStatesConnector", (), {})
    monkeypatch.delitem(sys.modules, "hs_connectors.fp8_hidden_states_connector", raising=False)


def _speculators(env, out: Path, fp8: bool, monkeypatch) -> Path:
    """speculators' layout: the Arrow dataset (``save_to_disk``) and vLLM's ``hs_{i}.safetensors`` ([T, 4, H]
    bf16: three aux states and the last one before the final norm), or hs-connectors' fp8 writer."""
    datasets = _import_or_skip("datasets", "datasets")
    examples = env["examples"]
    rows = {"input_ids": [e[0].tolist() for e in examples], "loss_mask": [e[1].tolist() for e in examples],
            "seq_len": [len(e[0]) for e in examples]}
    ds = datasets.Dataset.from_dict(rows)
    ds.set_format("torch")
    ds.save_to_disk(str(out))
    (out / "hidden_states").mkdir()
    if fp8:
        _import_or_skip("hs_connectors", "hs-connectors==0.9.0")
        _stub_vllm(monkeypatch)
        from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector

        event = types.SimpleNamespace(synchronize=lambda: None)
    for i, (ids, _, aux, prenorm, _) in enumerate(env["examples"]):
        tensors = {"hidden_states": torch.cat([aux, prenorm[:, None]], 1).to(torch.bfloat16),
                   "token_ids": torch.as_tensor(ids)}
        path = str(out / "hidden_states" / f"hs_{i}.safetensors")
        if fp8:
            FP8HiddenStatesConnector._write_tensors(tensors, event, path, None)
        else:
            save_file(tensors, path)  # what vLLM's ExampleHiddenStatesConnector writes
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_speculators_files_train_as_our_cache_does(env, fp8, monkeypatch):
    hs = _import_or_skip("hs_connectors", "hs-connectors==0.9.0")
    name = "spec-fp8" if fp8 else "spec-bf16"
    folder = _speculators(env, env["root"] / name, fp8, monkeypatch)
    reader = open_cache(folder / "hidden_states")  # the hidden_states folder or the dataset's both work
    assert reader.kind == "speculators" and reader.final_prenorm
    transfer = (hs.FP8Transfer if fp8 else hs.FileTransfer)(folder / "hidden_states")
    norm = TargetWeights(env["target"]).final_norm(torch.float32, "cpu")
    states = {}
    for i, (ids, _, _, _, final) in enumerate(env["examples"]):
        theirs = transfer.get_cached(i)["hidden_states"]  # [T, 4, H] bf16, as their trainer reads it
        st = reader.read("train", i)
        assert st.aux.dtype == torch.bfloat16 and torch.equal(st.aux, theirs[:, :3])
        assert torch.equal(st.final, theirs[st.rows, 3])
        with torch.no_grad():
            states[tuple(ids.tolist())] = (theirs[:, :3].float().reshape(len(ids), -1), norm(theirs[:, 3].float()))
        if not fp8:
            assert torch.allclose(states[tuple(ids.tolist())][1], final, atol=0.05)  # the norm applied to pre-norm
    ours = _ours(env, f"ours-{name}", states)
    a, b = _train_losses(env, str(folder), f"t-{name}"), _train_losses(env, ours, f"t-ours-{name}")
    assert len(a) == CFG.steps and np.allclose(a, b, rtol=1e-5, atol=0), (a, b)


def test_unreadable_peer_files_are_one_line_refusals(env, tmp_path, capsys):
    cfg = CFG.save(tmp_path / "cfg.json")

    def refused(folder: Path) -> str:
        code = cli_main(["train", env["target"], "--cache", str(folder), "--out", str(tmp_path / "o"), "--config",
                         str(cfg), "--quiet"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        return err

    ids = torch.arange(5, 12)
    dflash = tmp_path / "dflash" / "rows_0-2000"
    dflash.mkdir(parents=True)
    torch.save({"input_ids": ids, "loss_mask": torch.ones(7, dtype=torch.long),
                "hidden_states": torch.zeros(1, 7, 192)}, dflash / "data_0.ckpt")
    assert "not an EAGLE-3 record" in refused(dflash.parent)
    code = tmp_path / "code" / "rows_0-2000"
    code.mkdir(parents=True)
    torch.save({"input_ids": ids, "extra": types.SimpleNamespace(a=1)}, code / "data_0.ckpt")  # needs unpickling
    assert "weights_only" in refused(code.parent)
    empty = tmp_path / "empty" / "rows_0-2000"
    empty.mkdir(parents=True)
    torch.save({"input_ids": ids, "loss_mask": torch.zeros(7, dtype=torch.long), "aux_hidden_state":
                torch.zeros(1, 7, 192), "hidden_state": torch.zeros(1, 7, 64)}, empty / "data_0.ckpt")
    assert "no loss tokens" in refused(empty.parent)
    nan = tmp_path / "nan" / "rows_0-2000"  # a NaN state: no checksum to fail, refused when read
    nan.mkdir(parents=True)
    for i in range(8):
        aux = torch.zeros(1, 7, 192)
        aux[0, 2, 5] = float("nan")
        torch.save({"input_ids": ids, "loss_mask": torch.ones(7, dtype=torch.long), "aux_hidden_state": aux,
                    "hidden_state": torch.zeros(1, 7, 64)}, nan / f"data_{i}.ckpt")
    assert "tensor aux_hidden_state holds 1 non-finite" in refused(nan.parent)
    three = tmp_path / "three" / "hidden_states"
    three.mkdir(parents=True)
    save_file({"hidden_states": torch.zeros(7, 3, 64), "token_ids": ids}, str(three / "hs_0.safetensors"))
    assert "Arrow dataset" in refused(three)
    datasets = _import_or_skip("datasets", "datasets")
    datasets.Dataset.from_dict({"input_ids": [ids.tolist()], "loss_mask": [[1] * 7]}).save_to_disk(str(three.parent))
    capsys.readouterr()
    assert "three aux states and the last" in refused(three.parent)
    (tmp_path / "nothing").mkdir()
    assert "not a hidden-state cache" in refused(tmp_path / "nothing")
