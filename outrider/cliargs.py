"""Command-line values checked before any work starts, and OS errors told as one line.

Contract: every numeric flag is parsed by a type from here that states its range (``IntRange``,
``FloatRange``, ``int_list``), so a value out of range is refused at parse time with one line
saying the range; ``device`` refuses a device this machine does not have. ``check_args`` runs the
checks that join several flags or look at an input's kind (k within max-new-tokens, a draft of
the kind the method needs) before the verb starts. ``train_options`` checks ``train``'s flags once
into a ``TrainOptions`` (``outrider.train.options``); ``stream_options`` the streaming flags that
``train`` and ``capture`` share.
``OneLineParser`` prints an argument error as one line (no usage block), exit status 2.
``user_os_error`` finds the ``OSError`` a user can fix (permissions, a read-only or full file
system, a path through a file, a folder where a file belongs, a name too long:
``fsutil.USER_ERRNOS``) behind an exception, for ``fsutil.os_error_line``. Nothing heavy is
imported at module level, so ``outrider --help`` stays instant.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from outrider.decode.proposers import PROPOSERS
from outrider.errors import UserError
from outrider.fsutil import USER_ERRNOS, os_error_line, read_text
from outrider.interop.drafts import DRAFTS, folder_kind

if TYPE_CHECKING:
    from outrider.train.options import StreamOptions, TrainOptions

K_MAX = 64  # draft tokens per step: a verification forward of k+1 positions, k+1 cache slots a step

class OneLineParser(argparse.ArgumentParser):
    """``argparse`` whose errors are one line: ``outrider VERB: error: ...``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


class IntRange:
    """An argparse type: an integer in ``lo..hi`` (``hi`` None: no upper bound)."""

    def __init__(self, lo: int, hi: int | None = None, why: str = ""):
        self.lo, self.hi, self.why = lo, hi, why
        self.__name__ = "integer"

    def describe(self) -> str:
        return f"an integer >= {self.lo}" if self.hi is None else f"an integer in {self.lo}..{self.hi}"

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got '{text}'") from None
        if value < self.lo or (self.hi is not None and value > self.hi):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}{self.why}, got {value}")
        return value


class FloatRange:
    """An argparse type: a finite number in ``[lo, hi]``; ``open_lo``/``open_hi`` exclude the ends."""

    def __init__(self, lo: float | None = None, hi: float | None = None, open_lo: bool = False,
                 open_hi: bool = False):
        self.lo, self.hi, self.open_lo, self.open_hi = lo, hi, open_lo, open_hi
        self.__name__ = "number"

    def describe(self) -> str:
        if self.hi is None:
            return f"a number {'>' if self.open_lo else '>='} {self.lo:g}"
        return (f"a number in {'(' if self.open_lo else '['}{self.lo:g}, {self.hi:g}"
                f"{')' if self.open_hi else ']'}")

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got '{text}'") from None
        ok = math.isfinite(value)
        if ok and self.lo is not None:
            ok = value > self.lo if self.open_lo else value >= self.lo
        if ok and self.hi is not None:
            ok = value < self.hi if self.open_hi else value <= self.hi
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text}")
        return value


POSITIVE = IntRange(1)
NONNEGATIVE = IntRange(0)
SEED = IntRange(0, 2**63 - 1)
K = IntRange(1, K_MAX, " (draft tokens per step)")


def int_list(lo: int, hi: int | None = None, what: str = "integers"):
    """An argparse type: comma-separated integers, each in ``lo..hi``."""
    each = IntRange(lo, hi)

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got '{text}'") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got nothing")
        bad = [v for v in values if v < lo or (hi is not None and v > hi)]
        if bad:
            raise argparse.ArgumentTypeError(f"{what} must each be {each.describe()}, got {bad[0]}")
        return values

    parse.__name__ = what
    return parse


def names_of(allowed: tuple[str, ...]):
    """An argparse type: comma-separated names from ``allowed`` (or ``all``)."""

    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in allowed and n != "all"]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"expected comma-separated names from {', '.join(allowed)} or all, "
                                             f"got '{text}'")
        return names

    parse.__name__ = "names"
    return parse


def batch_values(lo: float, hi: float | None = None):
    """An argparse type: 'VALUE' (batch 1) or 'BATCH:VALUE,...' with batches >= 1 and values in range."""
    value_type = FloatRange(lo, hi, open_lo=hi is None)

    def parse(text: str) -> dict[int, float]:
        out = {}
        for part in text.split(","):
            if not part.strip():
                continue
            b, _, v = part.rpartition(":")
            try:
                batch = int(b) if b else 1
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected VALUE or BATCH:VALUE,..., got '{text}'") from None
            if batch < 1:
                raise argparse.ArgumentTypeError(f"batch sizes must be integers >= 1, got {batch}")
            out[batch] = value_type(v)
        if not out:
            raise argparse.ArgumentTypeError(f"expected VALUE or BATCH:VALUE,..., got '{text}'")
        return out

    parse.__name__ = "values"
    return parse


def device(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N``, refused unless this machine has it."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not (kind == "cuda" and index.isdigit())):
        raise argparse.ArgumentTypeError(f"unknown device '{text}': use cpu, cuda or cuda:N")
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"'{text}' was asked for but CUDA is not available on this machine: "
                                             "use --device cpu")
        if index and int(index) >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"'{text}' does not exist: this machine has "
                                             f"{torch.cuda.device_count()} GPU(s)")
    return text


DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "auto")


def dtype(text: str) -> str:
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype '{text}': use float32, bfloat16 or float16")
    return text


# --------------------------------------------------------------------------------------------
# Checks that join flags or look at inputs, before the verb starts


def tree_option(a: argparse.Namespace):
    """``--tree TOPK,STEPS,TOKENS`` or ``--tree-paths FILE`` -> an ``outrider.trees`` TreeBudget or
    StaticTree (checked), or None for chains."""
    from outrider.trees import TreeBudget, static_tree

    tree, paths = getattr(a, "tree", None), getattr(a, "tree_paths", None)
    if tree is None and paths is None:
        return None
    if tree is not None and paths is not None:
        raise UserError("--tree and --tree-paths both give the tree: choose one")
    method = getattr(a, "method", "eagle3")  # export: the head's own
    if not PROPOSERS[method].trees:
        raise UserError(f"--tree and --tree-paths draft trees from an EAGLE-3 head: use --method eagle3 --draft HEAD "
                        f"(--method {method} drafts chains)")
    if tree is not None:
        return TreeBudget.parse(tree)
    try:
        text = read_text(paths)
    except OSError as e:
        raise UserError(f"--tree-paths: {os_error_line(e, paths)}") from None
    return static_tree(text, where=f"--tree-paths {paths}")


def export_launch(a: argparse.Namespace) -> tuple[int, Any]:
    """``export``'s launch settings: (k, tree) from ``--bench F`` (the EAGLE-3 record of the best
    end-to-end speedup: its chain's k or its tree; a topk-1 budget is its chain), else
    ``--num-speculative-tokens`` and ``--tree``/``--tree-paths``."""
    from outrider.records import read_records
    from outrider.trees import TreeBudget

    tree = tree_option(a)
    if a.bench is None:
        return a.num_speculative_tokens, tree
    if tree is not None:
        raise UserError("--bench picks the measured best chain or tree: leave out --tree and --tree-paths")
    ok = [r for r in read_records(a.bench, "--bench") if r.method == "eagle3" and r.speedup_vs_ar is not None and r.k is not None]
    if not ok:
        raise UserError(f"--bench {a.bench}: no eagle3 bench record (method, k, speedup_vs_ar)")
    best = max(ok, key=lambda r: (r.speedup_vs_ar, r.tau or 0))
    return best.k, None if isinstance(best.tree, TreeBudget) and best.tree.is_chain else best.tree


def _check_decoding(a: argparse.Namespace) -> None:
    a.tree_spec = tree_option(a)  # parsed once: the verb reads ``tree_spec``
    if a.method == "ar":
        return
    if a.k > a.max_new_tokens:
        raise UserError(f"--k {a.k} exceeds --max-new-tokens {a.max_new_tokens}: a step cannot emit more tokens "
                        "than are asked for; lower --k")
    needs = PROPOSERS[a.method].needs
    if needs is not None:
        if a.draft is None:
            raise UserError(f"--method {a.method} needs --draft")
        kind = folder_kind(a.draft)
        if DRAFTS[needs].folder == "head" and kind == "model":
            raise UserError(f"--draft {a.draft} is a full model, not {DRAFTS[needs].what}: use --method draft for a "
                            "draft model")
        if needs == "model" and kind == "head":
            raise UserError(f"--draft {a.draft} is an EAGLE-3 head, not a draft model: use --method eagle3")


def _check_plan(a: argparse.Namespace) -> None:
    if a.tau is not None and not 1.0 <= a.tau <= a.tau_k + 1:
        raise UserError(f"--tau {a.tau:g} is impossible at --tau-k {a.tau_k}: tokens per step lie in "
                        f"[1, {a.tau_k + 1}] (at most k drafts plus one)")


def _check_bench(a: argparse.Namespace) -> None:
    if a.compare and a.server:
        raise UserError("--compare reads two earlier runs and --server measures a new one: give only one")
    if a.baseline_server and not a.server:
        raise UserError("--baseline-server needs --server (the speculative deployment to compare with it)")
    served_only = [flag for flag, value in (("--server-model", a.server_model),
                                            ("--baseline-server-model", a.baseline_server_model)) if value]
    if served_only and not a.server:
        raise UserError(f"{served_only[0]} names a model on a served engine: it needs --server URL")
    if a.target is None and not (a.server or a.compare):
        raise UserError("bench needs a target T (our engine), or --server URL (a served engine)")


def check_args(a: argparse.Namespace) -> None:
    """The verb's checks that join several flags or look at an input's kind (``UserError``)."""
    if a.verb == "bench":
        _check_bench(a)
    if a.verb == "generate" or (a.verb == "bench" and not (a.server or a.compare)):
        _check_decoding(a)  # a served run's --method names what the server runs; its --draft is optional
    elif a.verb == "plan":
        _check_plan(a)


def stream_options(a: argparse.Namespace) -> StreamOptions | None:
    """``--stream-layers [--gpu-memory GB] [--tokens-per-pass N]`` -> ``StreamOptions``, or None
    (``train`` and ``capture`` share it)."""
    from outrider.train.options import StreamOptions

    if not a.stream_layers:
        if a.gpu_memory is not None or a.tokens_per_pass is not None:
            raise UserError("--gpu-memory and --tokens-per-pass size layer streaming: add --stream-layers")
        return None
    if a.device_map is not None:
        raise UserError("--stream-layers and --device-map are two ways to fit a large target: give one")
    return StreamOptions(gpu_memory=a.gpu_memory, tokens_per_pass=a.tokens_per_pass)


def train_options(a: argparse.Namespace) -> TrainOptions:
    """``outrider train``'s flags -> ``TrainOptions`` (``outrider.train.options``), checked once."""
    from outrider.train.options import TrainOptions

    if a.force and a.resume:
        raise UserError("--resume continues the run in --out and --force replaces it: give only one")
    if a.allow_change and not a.resume:
        raise UserError("--allow-change says what a --resume may find changed: give it with --resume")
    if a.force and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--force under torchrun: replace the run with one process first, or choose a new --out")
    stream = stream_options(a)
    return TrainOptions(target=a.target, data=a.data, out=a.out, cache=a.cache, preset=a.preset, config=a.config,
                        init=a.init, resume=a.resume, device=a.device, dtype=a.dtype, max_steps=a.max_steps,
                        aux_layer_ids=a.aux_layers, progress=not a.quiet, device_map=a.device_map,
                        offload_folder=a.offload_folder, stream=stream, allow_change=a.allow_change or (),
                        report_to=a.report_to, parallel_drafting=getattr(a, "parallel_drafting", False),
                        drafter=getattr(a, "drafter", None))


def user_os_error(e: BaseException) -> OSError | None:
    """The ``OSError`` a user can fix behind ``e``: ``e`` itself, one it was raised from, or, for
    writers that report one as text (``torch.save``, safetensors), one rebuilt from its message."""
    seen = 0
    cause: BaseException | None = e
    while cause is not None and seen < 8:
        if isinstance(cause, OSError) and cause.errno in USER_ERRNOS:
            return cause
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    text = str(e)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EFBIG):
        if os.strerror(code) in text:
            return OSError(code, os.strerror(code))
    return None


def stderr_line(verb: str, message: str) -> None:
    print(f"outrider {verb}: error: {' '.join(str(message).split())}", file=sys.stderr)


def output_of(a: argparse.Namespace) -> Any:
    """The verb's main output argument (named when an OS error carries no path)."""
    for name in ("out", "json", "plot"):
        value = getattr(a, name, None)
        if value not in (None, "-"):
            return os.fspath(value)
    return None


def engine_capture_flags(sp: argparse.ArgumentParser) -> None:
    """``capture``'s flags for hidden states taken from vLLM (``train.states.engine_source``)."""
    sp.add_argument("--engine", default=None, choices=["vllm"],
                    help="take the hidden states from vLLM (speculative method extract_hidden_states): one it "
                         "starts (`vllm` on PATH), or the one at --server")
    sp.add_argument("--server", default=None, metavar="URL",
                    help="with --engine: a running vLLM started with the extraction config (--print-command)")
    sp.add_argument("--engine-storage", default=None, metavar="DIR",
                    help="with --engine: the folder its connector writes to, as seen here (a temporary one when "
                         "outrider starts the server)")
    sp.add_argument("--engine-args", default="", metavar="ARGS",
                    help="with --engine and no --server: more `vllm serve` arguments, e.g. '--tensor-parallel-size 8'")
    sp.add_argument("--timeout", type=FloatRange(0, open_lo=True), default=120.0, metavar="S",
                    help="with --engine: bounds every wait on the server and on its files (default 120)")
    sp.add_argument("--print-command", action="store_true",
                    help="with --engine: print the `vllm serve` command that --server expects, and exit")


def check_engine_capture(a: argparse.Namespace) -> None:
    if (a.server or a.engine_storage or a.engine_args or a.print_command) and not a.engine:
        raise UserError("--server, --engine-storage, --engine-args and --print-command go with --engine vllm")
    if a.engine and (a.stream_layers or a.device_map):
        raise UserError("--engine takes the states from the engine: leave out --stream-layers and --device-map")
