"""Hidden states from a vLLM server: a capture source (``cache_capture``) fed by the engine the user runs.

Contract:
- vLLM's speculative method ``extract_hidden_states`` with a hidden-states connector writes, for
  each request, ``{storage}/{request}.safetensors`` with ``token_ids`` [T] (the prompt) and
  ``hidden_states`` [T, k, H] of the layer ids listed in its ``eagle_aux_hidden_state_layer_ids``,
  and answers with ``kv_transfer_params.hidden_states_path``. vLLM's id ``j`` is the state
  entering decoder layer ``j`` and id ``L`` the last layer's output before the final norm (its
  models append the residual stream before running the layers listed, and after the last):
  outrider's convention, checked by the engine tier's equality test, not assumed.
- ``extraction_args(target, ids, num_layers, storage, cpu)``: the ``vllm serve`` arguments that
  make a server extract the aux ids and ``L``: ``--speculative-config`` (the method, one token,
  the ids) and ``--kv-transfer-config`` (vLLM's ``ExampleHiddenStatesConnector``; on a machine
  without CUDA outrider's ``SyncHiddenStatesConnector``, whose stock writer needs CUDA).
- ``EngineSource(target, ids, server, storage)``: each sequence is one completion request
  (``prompt`` = its token ids, one new token, greedy), ``concurrency`` in flight; the reply's file
  is read once its ``.lock`` is free (the connector holds it until the file is whole), checked
  (the tokens must be the request's, the shape [T, 4, H], finite values), then deleted with its
  lock, so the engine's files never pile up. ``storage`` is where this process sees the server's
  storage folder (the reply's path is read there by name). The final state is the last one put
  through the target's own final norm (``TargetWeights.final_norm``, float32). With
  ``process`` (a ``ServerProcess``) the source starts that server on entry and stops it on exit.
- Faults are one line (``UserError``): a server that cannot be reached or stops answering
  (after the client's retries), a reply without a path, a file missing past ``timeout``, cut short
  or holding other tokens. The capture keeps its finished shards; a rerun resumes.

Not done here: the cache (``cache_capture``), starting servers (``interop.server_process``), the
engine's side of the files (``interop.vllm_connector``).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import torch

from outrider.errors import UserError
from outrider.interop.openai_client import ChatClient, ServerRejected
from outrider.interop.server_process import ServerFailed, ServerProcess
from outrider.train.states.peers import read_connector_file
from outrider.train.states.target_weights import TargetWeights

STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
SYNC_CONNECTOR = ("SyncHiddenStatesConnector", "outrider.interop.vllm_connector")
KEPT = "the finished shards are kept: rerun the same command to go on"


def engine_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The ids a server extracts: the aux ids, then ``L`` (the last layer's output, pre-norm)."""
    return [int(j) for j in aux_layer_ids] + [int(num_layers)]


def extraction_args(target: str, aux_layer_ids: Sequence[int], num_layers: int, storage: str | Path,
                    cpu: bool = False) -> list[str]:
    """``vllm serve`` arguments (after the target) for a server that extracts these states into ``storage``."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids":
                                                 engine_layer_ids(aux_layer_ids, num_layers)}}}
    kv: dict[str, Any] = {"kv_connector": STOCK_CONNECTOR, "kv_role": "kv_producer",
                          "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    if cpu:
        kv.update(kv_connector=SYNC_CONNECTOR[0], kv_connector_module_path=SYNC_CONNECTOR[1])
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]


def outrider_root() -> str:
    """The folder holding the ``outrider`` package: a CPU server needs it on its ``PYTHONPATH``."""
    return str(Path(__file__).resolve().parents[3])


class EngineSource:
    """A capture source whose states come from a vLLM server (see the module docstring)."""

    def __init__(self, target: str, aux_layer_ids: Sequence[int], server: str | None, storage: str | Path,
                 num_layers: int, hidden_size: int, process: ServerProcess | None = None, timeout: float = 120.0,
                 concurrency: int = 4, pass_tokens: int = 16384, model: str | None = None, retries: int = 5,
                 own_storage: bool = False):
        self.aux_layer_ids = tuple(int(j) for j in aux_layer_ids)
        self.hidden_size = int(hidden_size)
        self.pass_tokens = int(pass_tokens)
        self.target, self.server, self.storage = target, server, Path(storage)
        self.num_layers, self.process, self.timeout = int(num_layers), process, float(timeout)
        self.concurrency, self.model, self.retries = int(concurrency), model, int(retries)
        self.own_storage = own_storage  # a temporary folder made for a server started here: removed on exit
        self.client: ChatClient | None = None
        self.norm: torch.nn.Module | None = None
        self.pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> "EngineSource":
        weights = TargetWeights(self.target)
        try:
            self.norm = weights.final_norm(torch.float32, "cpu")
        finally:
            weights.close()
        if self.process is not None:
            self.process.start()
            try:
                self.process.wait_ready(timeout=max(self.timeout, 900.0))
            except ServerFailed as e:
                self.process.stop()
                raise UserError(f"vLLM did not start: {e.line} (its log: {e.log})") from None
            self.server = self.process.url
        self.client = ChatClient(self.server, self.model, timeout=self.timeout, retries=self.retries)
        self.model = self.client.check()
        self.pool = ThreadPoolExecutor(max_workers=max(1, self.concurrency))
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.process is not None:
            self.process.stop()
        if self.own_storage:
            import shutil

            shutil.rmtree(self.storage, ignore_errors=True)

    def states(self, input_ids: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.pool is not None, "enter the source first"
        return list(self.pool.map(self._one, input_ids))

    def _one(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        body = {"model": self.model, "prompt": [int(t) for t in ids], "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {}}
        try:
            reply = self.client.post("/v1/completions", body, KEPT)
        except ServerRejected as e:
            raise UserError(f"the vLLM server at {self.server} refused a sequence of {len(ids)} tokens ({e}); "
                            f"{KEPT}") from None
        path = ((reply.get("kv_transfer_params") or {}) if isinstance(reply, dict) else {}).get("hidden_states_path")
        if not path:
            raise UserError(f"the server at {self.server} gave no hidden_states_path: start it with outrider's "
                            "extraction config (`outrider capture --engine vllm --print-command`)")
        local = self.storage / Path(path).name
        hs, tokens = self._read(local)  # [T, k, H], [T]
        n_aux, H = len(self.aux_layer_ids), self.hidden_size
        if tokens.tolist() != [int(t) for t in ids]:
            raise UserError(f"{local} holds other tokens than the request ({len(tokens)} against {len(ids)}): the "
                            f"server or its storage folder is shared with another client; {KEPT}")
        if hs.shape[1:] != (n_aux + 1, H):
            raise UserError(f"{local} holds hidden states [T, {hs.shape[1]}, {hs.shape[2]}]; the capture wants "
                            f"[T, {n_aux + 1}, {H}] (aux ids {list(self.aux_layer_ids)} and the last layer): start "
                            "the server with the ids the capture uses")
        aux = hs[:, :n_aux].reshape(len(ids), n_aux * H)  # [T, n_aux * H]
        with torch.no_grad():
            final = self.norm(hs[:, n_aux].float())  # [T, H]
        return aux, final

    def _read(self, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        """The connector's file, once whole (its lock free), then deleted with its lock."""
        lock = Path(f"{path}.lock")
        deadline = time.monotonic() + self.timeout
        while True:
            if lock.exists():
                try:
                    with open(lock) as fd:
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        if path.exists():
                            break
                except BlockingIOError:
                    pass
                except FileNotFoundError:
                    continue
            elif path.exists():
                break
            if time.monotonic() > deadline:
                raise UserError(f"{path} did not appear within {self.timeout:.0f} s: is --engine-storage the folder the "
                                f"server writes to (its shared_storage_path)? {KEPT}")
            time.sleep(0.01)
        try:
            return read_connector_file(path)
        finally:
            for p in (path, lock):
                try:
                    os.remove(p)
                except FileNotFoundError:
                    pass


def vllm_source(target: str, aux_layer_ids: Sequence[int] | None, server: str | None, storage: str | None,
                engine_args: str = "", concurrency: int = 4, timeout: float = 120.0) -> EngineSource:
    """The source ``outrider capture --engine vllm`` uses: attached to ``server`` (whose connector
    writes into ``storage``), or a ``vllm serve`` of the target started here (storage: a new
    temporary folder unless given; ``engine_args`` added to its command line, e.g.
    ``--tensor-parallel-size 8``)."""
    import shlex
    import shutil
    import tempfile

    from outrider.models import arch_info, load_config_dict, resolve

    info = arch_info(load_config_dict(target))
    ids = sorted(int(j) for j in (aux_layer_ids if aux_layer_ids is not None else info.default_aux_layer_ids()))
    process, own = None, False
    if server is not None:
        if storage is None:
            raise UserError("--engine vllm --server URL needs --engine-storage DIR: the folder that server's connector "
                            "writes to (its shared_storage_path), as this machine sees it")
        if engine_args:
            raise UserError("--engine-args is for a server outrider starts: leave it out with --server")
    else:
        exe = shutil.which("vllm")
        if exe is None:
            raise UserError("no `vllm` command on PATH: install vLLM here, or start it yourself with the command "
                            "`outrider capture ... --engine vllm --print-command` prints and pass --server")
        own = storage is None
        storage = storage or tempfile.mkdtemp(prefix="outrider-engine-")
        cpu = not torch.cuda.is_available()
        env = dict(os.environ)
        if cpu:  # the CPU build's connector is outrider's own: the server imports it from this tree
            env["PYTHONPATH"] = os.pathsep.join(p for p in (outrider_root(), env.get("PYTHONPATH")) if p)
        argv = [exe, "serve", str(resolve(target)), "--host", "127.0.0.1", "--port", "{port}",
                *extraction_args(str(resolve(target)), ids, info.num_layers, storage, cpu=cpu),
                *(["--enforce-eager"] if cpu else []), *shlex.split(engine_args or "")]
        process = ServerProcess(argv, env=env, log=Path(storage) / "vllm.log")
    Path(storage).mkdir(parents=True, exist_ok=True)
    return EngineSource(target, ids, server, storage, info.num_layers, info.hidden_size, process=process,
                        concurrency=concurrency, timeout=timeout, own_storage=own)


def print_command(target: str, aux_layer_ids: Sequence[int] | None, storage: str | None) -> str:
    """The ``vllm serve`` line to start by hand for ``--engine vllm --server``: vLLM's own connector
    where this machine has CUDA, else outrider's (the server then imports it from this tree)."""
    import shlex

    from outrider.models import arch_info, load_config_dict, resolve

    info = arch_info(load_config_dict(target))
    ids = sorted(int(j) for j in (aux_layer_ids if aux_layer_ids is not None else info.default_aux_layer_ids()))
    cpu = not torch.cuda.is_available()
    path = str(resolve(target))
    args = extraction_args(path, ids, info.num_layers, storage or "/path/to/engine-states", cpu=cpu)
    line = ["vllm", "serve", shlex.quote(path), *map(shlex.quote, args), *(["--enforce-eager"] if cpu else [])]
    return " ".join(([f"PYTHONPATH={shlex.quote(outrider_root())}"] if cpu else []) + line)
