"""Targets placed through accelerate (--device-map): CPU and disk offload give the same states, training
and regeneration; bad maps are one-line errors."""

from __future__ import annotations

import json
import random

import pytest
import torch

from outrider.errors import UserError
from outrider.models import (
    AuxCapture,
    input_device,
    is_dispatched,
    load_model,
    parse_device_map,
)
from outrider.train.states.capture import TargetCapture


def offload_map(config, disk_every: int = 2) -> dict[str, str]:
    """Every other module on the disk, the rest on the CPU (the lm_head and the final norm on the disk)."""
    names = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(config.num_hidden_layers)]
    mapping = {n: "disk" if i % disk_every else "cpu" for i, n in enumerate(names)}
    return mapping | {"model.norm": "disk", "model.rotary_emb": "cpu", "lm_head": "disk"}


def test_parse_device_map(tmp_path):
    assert parse_device_map(None) is None and parse_device_map("auto") == "auto"
    assert parse_device_map(' {"model": 0, "lm_head": "cpu"} ') == {"model": 0, "lm_head": "cpu"}
    f = tmp_path / "map.json"
    f.write_text(json.dumps({"": "disk"}))
    assert parse_device_map(str(f)) == {"": "disk"}
    for bad, match in [("fastest", "neither"), ("{nope", "not valid JSON"), ("[]", "neither"),
                       ('{"model": "tpu"}', "maps to 'tpu'"), ("{}", "must be an object")]:
        with pytest.raises(UserError, match=match) as e:
            parse_device_map(bad)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_cpu_and_disk_offload_give_the_same_states(tiny_dir, kind, tmp_path):
    folder = tiny_dir(kind)
    plain, _ = load_model(folder, device="cpu", with_tokenizer=False)
    placed, _ = load_model(folder, device="cpu", with_tokenizer=False, device_map=json.dumps(offload_map(plain.config)),
                           offload_folder=tmp_path / "offload")
    assert is_dispatched(placed) and not is_dispatched(plain)
    assert placed.lm_head.weight.device.type == "meta"  # really offloaded
    assert input_device(placed) == torch.device("cpu")
    ids = torch.randint(5, 90, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    draft_ids = torch.arange(10, 70)
    with TargetCapture(plain, (0, 2, 3), draft_ids) as a, TargetCapture(placed, (0, 2, 3), draft_ids,
                                                                          device="cpu") as b:
        x, y = a(ids, mask), b(ids, mask)
    assert torch.equal(x.aux, y.aux) and torch.equal(x.teacher, y.teacher)
    with AuxCapture(placed, (1,)) as cap, torch.no_grad():
        placed(ids)
        assert cap.concat().shape == (3, 11, placed.config.hidden_size)


def test_bad_map_is_one_line(tiny_dir, tmp_path):
    with pytest.raises(UserError) as e:  # layers 1..3 are on no device
        load_model(tiny_dir("llama"), device="cpu", with_tokenizer=False,
                   device_map='{"model.embed_tokens": "cpu", "model.layers.0": "disk"}', offload_folder=tmp_path)
    assert "does not give any device" in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 500
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="0 GPU"):
            load_model(tiny_dir("llama"), device="cpu", with_tokenizer=False, device_map='{"": "cuda:0"}')


def _conversations(path, n=24, seed=0):
    rng = random.Random(seed)
    records = []
    for i in range(n):
        turns = []
        for _ in range(2):
            turns.append({"from": "human", "value": " ".join(f"w{rng.randrange(5, 90)}" for _ in range(5))})
            turns.append({"from": "gpt", "value": " ".join(f"w{rng.randrange(5, 60)}" for _ in range(9))})
        records.append({"id": f"c{i}", "conversations": turns})
    path.write_text(json.dumps(records))
    return str(path)


def test_training_and_regeneration_with_offload_match(tiny_dir, tmp_path):
    from outrider.config import TrainConfig
    from outrider.train.data.datasets import load_dataset
    from outrider.train.data.prepare import build_dataset
    from outrider.train.loop.trainer import train
    from outrider.train.options import TrainOptions

    target = str(tiny_dir("llama"))
    mapping = json.dumps(offload_map(load_model(target, device="cpu", with_tokenizer=False)[0].config))
    src = _conversations(tmp_path / "c.json", n=6)
    common = dict(regenerate=True, max_new_tokens=5, eval_fraction=0.0, progress=False)
    build_dataset(target, src, str(tmp_path / "regen_a"), **common)
    build_dataset(target, src, str(tmp_path / "regen_b"), device_map=mapping, offload_folder=str(tmp_path / "off"),
                  **common)
    a, b = load_dataset(tmp_path / "regen_a"), load_dataset(tmp_path / "regen_b")
    assert len(a) == len(b) == 6 and all(torch.equal(a[i][0], b[i][0]) for i in range(len(a)))

    data = tmp_path / "data"
    build_dataset(target, _conversations(tmp_path / "d.json"), str(data), eval_fraction=0.2, progress=False)
    cfg = TrainConfig(steps=4, batch_size=2, grad_accum=1, max_length=48, lr=3e-3, warmup_steps=1, ttt_steps=2,
                      draft_vocab_size=40, eval_every=2, save_every=4, eval_examples=4, log_every=1,
                      aux_layer_ids=(1, 2, 3))
    ref = train(TrainOptions(target, str(data), str(tmp_path / "plain"), config=cfg, progress=False, device="cpu"))
    got = train(TrainOptions(target, str(data), str(tmp_path / "placed"), config=cfg, progress=False, device="cpu",
                             device_map=mapping, offload_folder=str(tmp_path / "off2")))
    lines = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
             for d in ("plain", "placed")]
    losses = [[r["loss"] for r in run if r["type"] == "train"] for run in lines]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    assert ref.best_sim_tau == got.best_sim_tau
    with pytest.raises(UserError, match="--device-map places the target"):
        build_dataset(target, src, str(tmp_path / "x"), device_map="auto", progress=False)
