"""The engine tier: every export and launch line served by a real vLLM (its CPU build), judged by
``bench --server``'s served-vs-offline check.

Each case exports a head whose walked tau is known (``permuted``: about 2 at k = 3), takes the
``vllm serve`` command from the export's own LAUNCH.md, adds only the CPU build's flags
(``engine_env.cpu_flags``), starts it, and runs ``outrider bench TARGET --server URL --draft
HEAD``: the served greedy outputs must equal ours and the served tau (vLLM's ``spec_decode_*``
counters) must be within 2 % of the offline tau counted as the engine counts. Broken exports (aux
ids shifted by one, ``d2t`` missing) must be flagged by the same check. A server that vLLM's CPU
backend refuses for a reason of its own (``CPU_REFUSALS``) skips with vLLM's error line; any other
failure to start fails the test. ``OUTRIDER_ENGINE_OUT`` (a folder), if set, keeps every served
record and server log for RESULTS.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import engine_env
import permuted
from safetensors.torch import load_file, save_file

from outrider.cli import main
from outrider.interop.formats.export import export, save_head
from outrider.interop.server_process import ServerFailed

pytestmark = pytest.mark.engine

TOLERANCE = 0.02  # served tau against the offline tau (engine's count)
MAX_NEW = 32
# vLLM CPU-backend refusals that are not an export's fault: (pattern, why)
CPU_REFUSALS = (r"not supported on (the )?CPU", r"CPU backend does not support", r"requires a CUDA",
                r"No common block size")  # a GQA draft (CPU_ATTN: blocks of 32n) on an MLA target (CPU_MLA: 16)


@pytest.fixture(scope="session")
def kept(tmp_path_factory) -> Path:
    out = os.environ.get("OUTRIDER_ENGINE_OUT")
    path = Path(out) if out else tmp_path_factory.mktemp("engine_out")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine_targets")
    return {kind: permuted.build_target(kind, root / kind) for kind in ("llama", "deepseek_v3")}


@pytest.fixture(scope="session")
def heads(targets, tmp_path_factory) -> dict[str, Path]:
    """Our own checkpoints (float32) of the three heads: the reference the offline side decodes with."""
    root = tmp_path_factory.mktemp("engine_heads")
    out = {}
    for name, kind, options in (("gqa", "llama", {}), ("parallel", "llama", {"parallel": True}),
                                ("mla", "deepseek_v3", {"attention": "mla"})):
        save_head(permuted.build_head(targets[kind], **options), root / name, target=str(targets[kind]))
        out[name] = root / name
    return out


def _prompts(tmp_path: Path, lines=permuted.PROMPTS) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def serve_and_bench(vllm, kept: Path, name: str, argv: list[str], target: Path, prompts: Path, dtype: str,
                    draft: Path | None = None, method: str = "eagle3", k: int = 3) -> dict:
    """Start ``argv`` (+ the CPU flags), bench it against here, stop it; the one served record."""
    log = kept / f"{name}.log"
    out = kept / f"{name}.json"
    server = engine_env.served(argv + engine_env.cpu_flags(dtype), vllm, log)
    with server:
        try:
            server.wait_ready(timeout=400)
        except ServerFailed as e:
            if any(re.search(p, e.line, re.I) for p in CPU_REFUSALS):
                pytest.skip(f"vLLM's CPU backend refuses {name}: {e.line}")
            pytest.fail(f"vLLM did not serve {name}: {e.line} (log: {log})")
        extra = ["--draft", str(draft)] if draft is not None else []
        rc = main(["bench", str(target), "--server", server.url, "--prompts", str(prompts), "--concurrency", "1",
                   "--max-new-tokens", str(MAX_NEW), "--k", str(k), "--method", method, "--dtype", dtype,
                   "--device", "cpu", "--timeout", "120", "--quiet", "--json", str(out), *extra])
    assert rc == 0, f"bench --server failed for {name} (see {log})"
    (record,) = json.loads(out.read_text())
    assert record["engine"] == "vllm" and record["engine_version"] == engine_env.VLLM_VERSION
    return record


def assert_served_as_here(record: dict, n_prompts: int) -> None:
    assert record["completed"] == n_prompts and record["outputs_equal_local"] == n_prompts, \
        record.get("output_differences")
    verdict = record["served_vs_offline"]
    assert record["tau"] is not None and record["offline_uncut_tau"] > 1.5, record
    assert abs(verdict["relative_difference"]) <= TOLERANCE, (record["tau"], record["offline_uncut_tau"])
    assert not verdict["flagged"]


def launch_argv(folder: Path) -> list[str]:
    argv = engine_env.launch_command(folder / "LAUNCH.md")
    assert argv[:2] == ["vllm", "serve"], argv
    return argv


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eagle3_export_served_as_launch_md_writes(vllm, kept, targets, heads, fmt, dtype, tmp_path):
    folder = tmp_path / f"{fmt}-{dtype}"
    export(str(heads["gqa"]), fmt, folder, target=str(targets["llama"]), dtype=dtype)
    argv = launch_argv(folder)
    assert engine_env.speculative_config(argv) == {"method": "eagle3", "model": str(folder),
                                                   "num_speculative_tokens": 3}
    record = serve_and_bench(vllm, kept, f"eagle3-{fmt}-{dtype}", argv, targets["llama"], _prompts(tmp_path),
                             dtype, draft=heads["gqa"])
    assert_served_as_here(record, len(permuted.PROMPTS))


def test_parallel_drafting_head_served(vllm, kept, targets, heads, tmp_path):
    folder = tmp_path / "peagle"
    export(str(heads["parallel"]), "vllm", folder, target=str(targets["llama"]), dtype="float32")
    argv = launch_argv(folder)
    assert engine_env.speculative_config(argv)["parallel_drafting"] is True
    record = serve_and_bench(vllm, kept, "peagle-vllm-float32", argv, targets["llama"], _prompts(tmp_path),
                             "float32", draft=heads["parallel"], method="parallel")
    assert_served_as_here(record, len(permuted.PROMPTS))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mla_head_served_on_a_deepseek_v3_target(vllm, kept, targets, heads, dtype, tmp_path):
    folder = tmp_path / f"mla-{dtype}"
    export(str(heads["mla"]), "vllm", folder, target=str(targets["deepseek_v3"]), dtype=dtype)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    record = serve_and_bench(vllm, kept, f"eagle3-mla-vllm-{dtype}", launch_argv(folder), targets["deepseek_v3"],
                             _prompts(tmp_path), dtype, draft=heads["mla"])
    assert_served_as_here(record, len(permuted.PROMPTS))


@pytest.mark.parametrize("kind, fmt, kv_heads", [("llama", "vllm", None), ("deepseek_v3", "vllm", None),
                                                 ("llama", "speculators", None), ("llama", "vllm", 1)])
def test_dflash_drafter_served(vllm, kept, targets, kind, fmt, kv_heads, tmp_path):
    """A DFlash drafter in each layout we write (z-lab's for ``vllm``, speculators'), served with
    LAUNCH.md's ``"method": "dflash"``; and one whose key/value heads are its own (``dflash_kv_heads``:
    one where the target has two), which the engine must size its drafter's cache by."""
    from outrider.interop.formats.dflash import write_dflash

    ours, folder = tmp_path / "ours", tmp_path / "dflash"
    drafter = permuted.build_dflash(targets[kind], kv_heads=kv_heads)
    write_dflash(drafter, ours, str(targets[kind]), dtype="float32")
    export(str(ours), fmt, folder, target=str(targets[kind]), dtype="float32", num_speculative_tokens=3)
    argv = launch_argv(folder)
    assert engine_env.speculative_config(argv) == {"method": "dflash", "model": str(folder),
                                                   "num_speculative_tokens": 3}
    name = f"dflash-{kind}-float32" if fmt == "vllm" else f"dflash-{fmt}-{kind}-float32"
    name += f"-kv{kv_heads}" if kv_heads else ""
    record = serve_and_bench(vllm, kept, name, argv, targets[kind], _prompts(tmp_path), "float32", draft=ours,
                             method="dflash")
    assert_served_as_here(record, len(permuted.PROMPTS))


def test_dflash_with_shifted_layer_ids_is_flagged(vllm, kept, targets, tmp_path):
    from outrider.interop.formats.dflash import write_dflash

    ours, folder = tmp_path / "ours", tmp_path / "dflash-shifted"
    write_dflash(permuted.build_dflash(targets["llama"]), ours, str(targets["llama"]), dtype="float32")
    export(str(ours), "vllm", folder, target=str(targets["llama"]), dtype="float32")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [j + 1 for j in cfg["dflash_config"]["target_layer_ids"]]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    record = serve_and_bench(vllm, kept, "broken-dflash-ids-shifted", launch_argv(folder), targets["llama"],
                             _prompts(tmp_path), "float32", draft=ours, method="dflash")
    verdict = record["served_vs_offline"]
    assert record["outputs_equal_local"] == len(permuted.PROMPTS)
    assert verdict["flagged"] and verdict["relative_difference"] < -0.3, (record["tau"], verdict)


def test_ngram_served(vllm, kept, targets, tmp_path):
    """vLLM's n-gram drafter on prompts that hold the target's continuation (a run of words, then its
    first word again): outputs equal ours and the engine's counters show drafts accepted."""
    lines = [" ".join(f"w{i}" for i in range(a, a + n)) + f" w{a}" for a, n in ((10, 12), (30, 20), (60, 16))]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    argv = ["vllm", "serve", str(targets["llama"]), "--speculative-config", json.dumps(spec)]
    record = serve_and_bench(vllm, kept, "ngram-float32", argv, targets["llama"], _prompts(tmp_path, lines),
                             "float32", method="ngram")
    assert record["completed"] == 3 and record["outputs_equal_local"] == 3, record.get("output_differences")
    assert record["tau"] is not None and record["tau"] > 1.5, record["tau"]


def _break(folder: Path, how: str) -> None:
    if how == "aux-ids-shifted":  # the SGLang off-by-one: the state leaving layer j instead of entering it
        cfg = json.loads((folder / "config.json").read_text())
        cfg["eagle_aux_hidden_state_layer_ids"] = [j + 1 for j in cfg["eagle_aux_hidden_state_layer_ids"]]
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    else:
        tensors = load_file(folder / "model.safetensors")
        del tensors["d2t"]
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("how", ["aux-ids-shifted", "d2t-missing"])
def test_broken_export_is_flagged_by_the_served_check(vllm, kept, targets, heads, how, tmp_path):
    folder = tmp_path / how
    export(str(heads["gqa"]), "vllm", folder, target=str(targets["llama"]), dtype="float32")
    _break(folder, how)
    record = serve_and_bench(vllm, kept, f"broken-{how}", launch_argv(folder), targets["llama"],
                             _prompts(tmp_path), "float32", draft=heads["gqa"])
    verdict = record["served_vs_offline"]
    assert record["outputs_equal_local"] == len(permuted.PROMPTS)  # lossless all the same: only acceptance drops
    assert verdict["flagged"] and verdict["relative_difference"] < -0.3, (record["tau"], verdict)
    shutil.rmtree(folder)
