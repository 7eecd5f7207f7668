"""Shared fixtures: tiny random targets, the pulled default model, GPU skipping."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_tiny, save_tiny, tiny_tokenizer  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", params=["llama", "deepseek_v3"])
def tiny_kind(request):
    return request.param


@pytest.fixture(scope="session")
def tiny_models():
    cache = {}

    def get(kind: str, seed: int = 0):
        if (kind, seed) not in cache:
            cache[(kind, seed)] = make_tiny(kind, seed)
        return cache[(kind, seed)]

    return get


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    cache = {}

    def get(kind: str = "llama", seed: int = 0, vocab: int | None = None):
        key = (kind, seed, vocab)
        if key not in cache:
            kwargs = {"vocab": vocab} if vocab else {}
            cache[key] = save_tiny(kind, tmp_path_factory.mktemp(f"{kind}{seed}"), seed, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct), pulled by `outrider pull`; skip if absent."""
    from outrider import assets

    path = assets.default_model_dir()
    if not (path / "config.json").exists():
        pytest.skip("default model not pulled (run `outrider pull`)")
    from outrider.models import load_model

    return load_model("default", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def vllm():
    """The engine tier's vLLM (its CPU build's venv, ``engine_env``); skipped with the installer's line."""
    import engine_env

    try:
        return engine_env.vllm_env()
    except engine_env.EngineUnavailable as e:
        pytest.skip(f"vLLM {engine_env.VLLM_VERSION} (CPU build) cannot be installed here: {e}")
