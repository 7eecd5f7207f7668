"""Plain greedy decoding, up to a chunk of steps per host synchronisation.

Contract: nothing needs the host between two greedy steps, so ``GreedyChunks`` runs them back to
back on the device (``CachedLM.greedy_run``: on CUDA with graphs, one graph per step that feeds
its own argmax back) and checks EOS once per chunk; a chunk never runs past the longest remaining
request, and a row that stops inside it keeps only its tokens up to the stop. The tokens are those
the reference step (``SpecEngine.step`` without a proposer) emits.
"""

from __future__ import annotations

from outrider.decode.runner import CachedLM
from outrider.decode.state import RequestState


class GreedyChunks:
    def __init__(self, target: CachedLM, chunk: int):
        self.target, self.chunk = target, chunk

    def __call__(self, state: RequestState) -> None:
        n = min(self.chunk, state.tokens_left())
        state.marks.mark("verify")
        toks = self.target.greedy_run(state.last, n)  # [batch, n]
        host = toks.tolist()
        for b in range(state.batch):
            i = 0
            while state.alive[b] and i < n:
                state.result.row_steps += 1
                state.emit(b, host[b][i:i + 1])
                i += 1
        state.result.steps += n
        state.marks.mark("observe")
        state.last = toks[:, -1]
