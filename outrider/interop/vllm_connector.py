"""A hidden-states connector for vLLM that writes each request's file synchronously.

Loaded inside a vLLM server (``--kv-transfer-config`` with ``"kv_connector":
"SyncHiddenStatesConnector"`` and ``"kv_connector_module_path":
"outrider.interop.vllm_connector"``; this module imports vLLM and nothing of outrider's). It is
vLLM's ``ExampleHiddenStatesConnector`` (the ``extract_hidden_states`` method's file writer:
``{storage}/{request}.safetensors`` holding ``hidden_states`` [tokens, layers, H] and
``token_ids`` [tokens]) without its CUDA parts: the stock writer copies through pinned memory
on a CUDA stream and a thread pool, which fails where there is no CUDA (vLLM's CPU build). Here
the states are copied and written in the engine's step, to a temporary name renamed into place,
and the companion ``.lock`` (held exclusively until then, as the stock connector does) is
released after the rename, so a reader that takes a shared lock sees the whole file or none.

Not done here: what is captured (the ``extract_hidden_states`` method), reading the files
(``outrider.train.states.engine_source``).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with synchronous, atomic writes (no CUDA needed)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._written: set[str] = set()  # requests whose file is in place, not yet reported

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)  # [blocks]
        slots = (torch.arange(self._block_size)[None, :] + blocks[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device),
                                       pending.token_ids.shape[0])  # [tokens, layers, H]
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        tmp = f"{pending.filename}.{os.getpid()}.tmp"
        try:
            save_file({"hidden_states": states.to("cpu").contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
            if lock_fd is not None:
                os.close(lock_fd)
        self._written.add(pending.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            for pending in getattr(metadata, "pending_saves", ()):
                self._submit_async_write(pending)
        finished = self._accumulated_finished_req_ids | finished_req_ids
        self._accumulated_finished_req_ids.clear()
        done = finished & self._written
        self._written -= done
        for req_id in finished - done:  # never saved (aborted, or another rank's): only its lock to let go
            lock_fd = self._lock_fds.pop(req_id, None)
            if lock_fd is not None:
                os.close(lock_fd)
        return done or None, None
