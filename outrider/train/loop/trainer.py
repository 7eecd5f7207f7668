"""Train an EAGLE-3 head on a frozen target: training-time test, exact resume, DDP.

Contract:
- ``train(options)`` (``outrider.train.options.TrainOptions``) takes, per micro-batch, the target's
  aux states and its teacher over the draft vocabulary from its target side
  (``outrider.train.states.side.TargetSide``: the target in memory, a hidden-state cache, or a
  layer-streamed target), then the training-time-test loss of the head (``ttt``). AdamW, warmup
  then cosine decay (over the steps or the ``time_budget_s``, whichever ends first), clipping,
  bf16 autocast on CUDA, accumulation, periodic evaluation; the best head has the highest
  simulated acceptance length at ``tau_k`` drafts.
- Each unroll step's loss is averaged over the loss positions of the whole global batch (counts
  known from the masks before any forward), so 1 and N processes compute the same gradient.
- The draft vocabulary comes from the training split's loss-token counts and is stored with
  every checkpoint (``outrider.train.data.vocab.run_vocab``); an ``init`` fine-tune keeps its
  head's. A resume refuses any change of what makes the result (``resume``) unless
  ``allow_change`` names it.
- ``signals``: SIGINT/SIGTERM stop the run at the next step boundary, after a checkpoint.
- ``out`` holds ``head/`` (the best head, servable), ``last/`` (the full training state:
  ``checkpoint``), ``metrics.jsonl`` (``metrics``, ``logs``) and ``train_config.json``; directories
  are swapped in atomically, so a run killed at any point leaves the previous complete ``last/``
  and ``head/``; ``report_to``: TensorBoard or W&B too (``logs``).
- Exact resume: ``resume=True`` continues with the next micro-batch of the same epoch order;
  bit-identical on CPU to a run never interrupted. ``run_ahead`` queues step n+1 before reading
  step n's metrics (equal results, bit-identical on CPU).
- Distributed: under ``torchrun`` each rank holds a DDP replica of the head and reads its share
  of each global batch; rank 0 writes. Resuming needs the same number of processes.
- User-fixable errors are one-line ``UserError``s raised before anything written is touched.

Not done here: flags (``outrider.cliargs``), the loss (``ttt``), the target sides
(``outrider.train.states``), the head's starting weights (``head_init``), FSDP2
(``dist.shard_head`` is the hook).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from outrider.config import TrainConfig, resolve_config
from outrider.errors import UserError
from outrider.interop.checkpoint import load_head
from outrider.heads.dflash import DFlashConfig, DFlashDrafter
from outrider.heads.eagle3 import Eagle3Config, Eagle3Head
from outrider.interop.formats.dflash import write_dflash
from outrider.interop.formats.export import save_head
from outrider.models import arch_info, load_tokenizer, parse_dtype
from outrider.progress import Bar
from outrider.signals import Interrupted, Signals
from outrider.train.data.datasets import BatchCursor, to_device
from outrider.train.data.vocab import DraftVocab, run_vocab
from outrider.train.loop import checkpoint, dist, flops, head_init, logs, soft_ce
from outrider.train.loop.dflash_loss import DFlashModule, dflash_loss, sample_anchors
from outrider.train.loop import resume as same_run
from outrider.train.loop.metrics import Launched, StepSums, Throughput, TrainReport, peak_flops
from outrider.train.loop.schedule import lr_factor
from outrider.train.loop.ttt import TTTModule, counted_positions, ttt_loss, walked_accept_len
from outrider.train.options import TrainOptions
from outrider.train.states.features import open_target
from outrider.train.states.side import TargetSide
from outrider.train.states.stream_train import StreamedOnline


def train(options: TrainOptions, *, loaded_target: Any = None, signals: Signals | None = None) -> TrainReport:
    """Train an EAGLE-3 head as ``options`` say (``outrider.train.options``) into ``options.out``.

    loaded_target: an already loaded target model, or ``(model, tokenizer)``, to skip loading
    signals:       SIGINT/SIGTERM stop the run at the next step boundary, after a checkpoint
    """
    logs.require(options.report_to)
    env = dist.init_from_env(options.device)
    try:
        return _Trainer(env, options, loaded_target, signals).run()
    finally:
        dist.shutdown(env)


class _Trainer:
    def __init__(self, env: dist.DistEnv, options: TrainOptions, loaded_target: Any = None,
                 signals: Signals | None = None):
        o = options
        self.t_start, self.report_to, self.log = time.perf_counter(), o.report_to, None
        self.signals, self.interrupt = signals, None
        self.env, self.target_name, self.data, self.init = env, str(o.target), str(o.cache or o.data), o.init
        self.out = Path(o.out).expanduser()
        self.last_dir, self.head_dir = self.out / "last", self.out / "head"
        self.progress, self.notes = o.progress and env.is_main, []
        self.resume_state = checkpoint.read_state(self.last_dir) if o.resume else None
        self._settings(o.preset, o.config, o.init, o.max_steps, o.aux_layer_ids, o.drafter)
        self._parallel(o.parallel_drafting, o.drafter, loaded_target)
        self._open_target(o, loaded_target)
        stream = o.stream.as_kwargs() if o.stream is not None else None
        self.identity = same_run.identity(o.data, o.cache, stream, parse_dtype(o.dtype, self.env.device),
                                          self.config.aux_layer_ids, self.target.config, self.config)
        self.changed = same_run.compare(self.resume_state.get("identity"), self.identity, o.allow_change) \
            if self.resume_state is not None else {}
        self._build_head(o.init)
        self._build_optimizer()
        self._restore()

    # -- setup pieces ---------------------------------------------------------------------------

    def _settings(self, preset: str | None, config: TrainConfig | str | None, init: str | None,
                  max_steps: int | None, aux_layer_ids: Sequence[int] | None, drafter: str | None) -> None:
        """The run's settings: the checkpoint's when resuming, else preset / config / flags."""
        env = self.env
        if self.resume_state is not None:
            self.config, self.preset = same_run.settings(self.resume_state, preset, config, aux_layer_ids, init,
                                                       env.world_size, env.device.type, drafter)
        else:
            if (self.last_dir / "trainer_state.pt").exists():
                raise UserError(f"{self.out} already holds a training run: pass --resume to continue it, "
                                "or choose a new --out")
            self.config, self.preset = resolve_config(preset, config, env.device.type, drafter)
            if aux_layer_ids is not None:  # with --drafter: a DFlash drafter reads any number of layers
                self.config = self.config.replace(aux_layer_ids=tuple(aux_layer_ids))
        cfg = self.config
        self.stop_at = cfg.steps if max_steps is None else int(max_steps)
        if not 1 <= self.stop_at <= cfg.steps:
            raise UserError(f"--max-steps {max_steps} must be in 1..{cfg.steps} (the schedule's steps; raise "
                            "'steps' in a --config file to train longer)")

    def _parallel(self, flag: bool, drafter: str | None, loaded: Any) -> None:
        """``--parallel-drafting`` into the settings, ``--drafter`` checked (a resumed run keeps its own:
        the flags must agree); a null ``mask_token_id`` of a parallel or DFlash run resolved from the
        target's tokenizer."""
        if drafter is not None and drafter != self.config.drafter:  # a new run's settings took the flag already
            raise UserError(f"--drafter {drafter}: the run being resumed trains a {self.config.drafter} drafter; "
                            "drop the flag or start a new run")
        if self.config.drafter == "dflash" and self.init is not None:
            raise UserError("--init fine-tunes an EAGLE-3 head; a DFlash drafter trains from scratch: drop --init")
        if flag and not self.config.parallel_drafting:
            if self.resume_state is not None:
                raise UserError("--parallel-drafting: the run being resumed trains an EAGLE-3 head; drop the flag "
                                "or start a new run")
            self.config = self.config.replace(parallel_drafting=True)
        if (self.config.parallel_drafting or self.config.drafter == "dflash") and self.config.mask_token_id is None:
            tokenizer = loaded[1] if isinstance(loaded, tuple) and loaded[1] is not None else None
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.target_name)
            self.config = self.config.replace(mask_token_id=head_init.mask_token_id(tokenizer))

    def _open_target(self, o: TrainOptions, loaded: Any) -> None:
        """The target side (``TargetSide``: ``states.features.open_target``, or
        ``states.stream_train.StreamedOnline``), its splits and embedding; a cache's or a streamed
        target's aux ids become the run's."""
        device = self.env.device
        if o.stream is not None:
            if loaded is not None:
                raise UserError("--stream-layers streams the target from its files: drop --device-map and --cache")
            if self.env.distributed:
                raise UserError("--stream-layers trains on one process: run it without torchrun")
            self.target: TargetSide = StreamedOnline(self.target_name, o.data, device, parse_dtype(o.dtype, device),
                                                     self.config.aux_layer_ids, o.stream)
        else:
            self.target = open_target(self.target_name, o.data, o.cache, device, o.dtype, loaded,
                                      self.config.aux_layer_ids, (o.device_map, o.offload_folder))
        self.config = self.config.replace(aux_layer_ids=self.target.aux_layer_ids or self.config.aux_layer_ids)
        self.notes.extend(self.target.notes)
        self.train_ds, self.eval_ds = self.target.splits["train"], self.target.splits["eval"]
        self.embedding = self.target.embedding
        env, cfg = self.env, self.config
        tokens = cfg.batch_tokens > 0
        self.global_batch = 0 if tokens else cfg.batch_size * env.world_size * cfg.grad_accum
        self.global_batch_tokens = cfg.batch_tokens * env.world_size * cfg.grad_accum
        need = env.world_size if tokens else cfg.batch_size * env.world_size
        if len(self.train_ds) < need:
            raise UserError(f"the training split has {len(self.train_ds)} conversations, fewer than one batch of "
                            f"{need} ({'one per process' if tokens else 'batch_size x processes'}): add data"
                            + ("" if tokens else " or lower batch_size"))

    def _build_head(self, init: str | None) -> None:
        """The draft vocabulary and the head: fresh, fine-tuned from ``init``, or the checkpoint's."""
        cfg, target_cfg = self.config, self.target.config
        vocab_size = arch_info(target_cfg).vocab_size
        init_head, init_vocab = None, None
        size = min(cfg.draft_vocab_size or 32000, vocab_size)
        if init is not None:
            init_head, _ = load_head(checkpoint.init_head_dir(init), target_config=target_cfg)
            if isinstance(init_head, DFlashDrafter):
                raise UserError(f"--init {init} is a DFlash drafter; --init fine-tunes an EAGLE-3 head")
            init_vocab = DraftVocab.from_mapping(init_head.d2t, init_head.t2d)
            size = init_vocab.draft_vocab_size
            if cfg.aux_layer_ids is not None and tuple(sorted(cfg.aux_layer_ids)) != init_head.config.aux_layer_ids:
                raise UserError(f"aux layer ids {list(cfg.aux_layer_ids)} differ from those of the --init head "
                                f"{list(init_head.config.aux_layer_ids)}: drop --aux-layers")
            self.config = cfg = cfg.replace(aux_layer_ids=init_head.config.aux_layer_ids, draft_vocab_size=size)
        saved = DraftVocab.load(self.last_dir) if self.resume_state is not None else None
        self.vocab, notes = run_vocab(self.train_ds, vocab_size, size, init_vocab, saved,
                                      "data" in self.changed)
        self.notes.extend(notes)
        # aux ids in ascending order: fc's column order is arbitrary and the engines capture in layer order
        aux_ids = sorted(cfg.aux_layer_ids) if cfg.aux_layer_ids is not None else None
        if cfg.drafter == "dflash":
            head_cfg = DFlashConfig.for_target(target_cfg, self.vocab.draft_vocab_size, cfg.mask_token_id,
                                               cfg.block_size, cfg.dflash_layers, aux_ids,
                                               cfg.dflash_kv_heads or None)
        else:
            head_cfg = Eagle3Config.for_target(target_cfg, self.vocab.draft_vocab_size, aux_ids,
                                               attention=cfg.head_attention, **cfg.head_options())
        if cfg.drafter != "dflash" and len(set(head_cfg.aux_layer_ids)) != 3:
            raise UserError(f"aux layer ids {list(head_cfg.aux_layer_ids)} repeat a layer (the target has "
                            f"{arch_info(target_cfg).num_layers} layers), so no engine could serve the head: "
                            "pass three distinct ids with --aux-layers")
        self.config = cfg = cfg.replace(aux_layer_ids=head_cfg.aux_layer_ids)
        if init_head is not None:  # a fine-tune keeps the --init head's architecture (attention, options)
            head_init.check_init_fits(init_head.config, head_cfg)
            head_cfg = init_head.config
        torch.manual_seed(cfg.seed)
        self.head = DFlashDrafter(head_cfg) if cfg.drafter == "dflash" else Eagle3Head(head_cfg)
        self.head.set_vocab(self.vocab.d2t, self.vocab.t2d)
        if init_head is not None:
            self.head.load_state_dict(init_head.state_dict())
        else:
            if cfg.init_from_target:
                head_init.init_from_target(self.head, self.target, self.vocab.draft_ids, need_rows=cfg.freeze_lm_head)
            if cfg.init_layer_from_target and cfg.drafter != "dflash":
                head_init.init_layer_from_target(self.head, self.target.last_layer())
        if self.resume_state is not None:
            self._load_head_weights(self.last_dir / "head")
        self.head.to(self.env.device)

    def _positions(self, batch: Any, where: dict[str, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The positions each draft's loss counts in a micro-batch (host tensors): every one for
        EAGLE-3, ``num_anchors`` drawn anchors per sequence for DFlash, the draw seeded by the
        batch's place in the run (``where``: the cursor's epoch and batch), so a resumed run and
        a run ahead draw the same."""
        cfg = self.config
        if cfg.drafter != "dflash":
            return counted_positions(batch.loss_mask, batch.attention_mask, cfg.ttt_steps)
        seed = ((cfg.seed * 1_000_003 + int(where["epoch"]) * 100_003 + int(where["batch"])) * 4096
                + self.env.rank) % 2**63
        return sample_anchors(batch.loss_mask, batch.attention_mask, cfg.draft_steps, cfg.num_anchors, seed)

    def _build_optimizer(self) -> None:
        env, cfg = self.env, self.config
        self.head.lm_head.requires_grad_(not cfg.freeze_lm_head)  # frozen: it stays as it started
        self.optimizer = torch.optim.AdamW([p for p in self.head.parameters() if p.requires_grad], lr=cfg.lr,
                                           betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        self.train_s = 0.0  # seconds inside optimizer steps so far (resumed runs included)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg, self._budget_used()))
        self.weights = cfg.step_weights()
        self.autocast = env.device.type == "cuda" and cfg.amp
        self.fused = cfg.loss_kernel if env.device.type == "cuda" and cfg.compile else False
        if self.fused == "triton" and not soft_ce.available():
            self.fused = "compile"
            self.notes.append("triton cannot be imported: the loss ran torch.compile'd (loss_kernel 'compile')")
        self.flops_per_token_target = self._target_flops_per_token()
        self.head_params = sum(p.numel() for p in self.head.parameters())  # for the per-step FLOPs
        self.peak, self.mfu_note = peak_flops(env.device)

    def _restore(self) -> None:
        """The run's position: fresh, or the checkpoint's (optimizer, schedule, data, sums)."""
        env, cfg = self.env, self.config
        self.step, self.best_step, self.best_score = 0, 0, -math.inf
        self.cursor = BatchCursor(self.train_ds, cfg, env, cfg.seed)
        self.last_eval: dict[str, Any] = {}
        self.window = StepSums(cfg.draft_steps)  # training sums since the last evaluation (no eval split)
        if self.resume_state is not None:
            s = self.resume_state
            self.optimizer.load_state_dict(s["optimizer"])
            self.scheduler.load_state_dict(s["scheduler"])
            self.step, self.best_step, self.best_score = int(s["step"]), int(s["best_step"]), float(s["best_score"])
            pos = s["position"]
            self.cursor = BatchCursor(self.train_ds, cfg, env, int(pos["seed"]), int(pos["epoch"]), int(pos["batch"]))
            self.last_eval = s.get("last_eval") or {}
            self.window.load_state(s["window"])
            self.train_s = float(s.get("train_s", 0.0))
            if self.step >= self.stop_at:
                self.notes.append(f"the checkpoint is already at step {self.step}: nothing to train")
        self.resumed_from = self.step if self.resume_state is not None else None
        self.cursor = self.target.follow(self.cursor)  # a streamed target captures the batches ahead

    def _load_head_weights(self, directory: Path) -> None:
        saved, saved_cfg = load_head(directory)
        if saved_cfg != self.head.config:
            raise UserError(f"the head in {directory} does not match this run's settings: train into a new --out")
        self.head.load_state_dict(saved.state_dict())

    def _target_flops_per_token(self) -> float:
        """Matmul FLOPs per token on the target's side (``flops``): online, its forward (the decoder's
        weights, routed experts at their top-k share) and the draft rows of lm_head; from a cache, the rows."""
        return self.target.flops_per_token(self.head.config.target_hidden_size * self.vocab.draft_vocab_size)

    def _step_flops(self, tokens: int, counted: torch.Tensor, pairs: int) -> tuple[float, float]:
        """(weights-only FLOPs, attention FLOPs) of one step: the target's forward, the head's
        forward and backward (``flops``)."""
        c = self.head.config
        lm = c.hidden_size * c.draft_vocab_size
        steps = self.config.draft_steps
        if self.config.drafter == "dflash":  # blocks of m positions per anchor (``flops.dflash_flops``)
            head, attention = flops.dflash_flops(c, self.head_params - lm, lm, tokens, counted, pairs)
            return self.flops_per_token_target * tokens + head, self.target.attention_flops(pairs) + attention
        weights = (self.flops_per_token_target * tokens
                   + flops.head_flops(self.head_params - lm, lm, tokens, float(counted.sum()), steps))
        attention = (self.target.attention_flops(pairs)
                     + flops.head_attention_flops(c, tokens, pairs, steps))
        return weights, attention

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> TrainReport:
        env, cfg = self.env, self.config
        if env.is_main:
            self._prepare_out()
        dist.barrier(env)
        objective = dist.wrap(self.objective(), env)
        bar = Bar(self.progress, "train", self.stop_at, completed=self.step,
                  fields="loss {loss} acc0 {acc0} tau {tau} {tps} tok/s")
        rate = Throughput(self.peak, env.world_size)  # this run's share (self.train_s counts resumed time too)
        if self.resume_state is not None:
            checkpoint.set_rng_state(self.resume_state["rng"])
        deferred = self.signals.deferred() if self.signals is not None else contextlib.nullcontext()
        try:
            with self.target_capture() as capture, deferred:
                self.capture = capture
                for launched, m, counted, queued, dt in self._steps(objective):
                    m["ahead"] = launched.ahead
                    self.train_s += dt
                    rate.add(m, dt, *self._step_flops(m["tokens"], counted, m["attn_pairs"]), self.train_s)
                    bar.update(self.step, loss=f"{m['loss']:.3f}", acc0=f"{m['per_step_acc'][0]:.2f}",
                               tau=f"{m['sim_tau_k']:.2f}", tps=f"{rate.recent():.0f}")
                    self._stop_early(queued)
                    end = self.step == self.stop_at and self.interrupt is None  # a signal's stop is no end
                    if env.is_main and (self.step % cfg.log_every == 0 or end):
                        self._log({"type": "train", **m})
                    if self.step % cfg.eval_every == 0 or end:
                        self._evaluate(bar)
                    if self.step % cfg.save_every == 0 or self.step == self.stop_at:
                        self._checkpoint()
                self.notes.extend(capture.notes)
        finally:
            bar.close()
            if self.log is not None:
                self.log.close()
        if self.interrupt is not None:
            raise Interrupted(self.interrupt, f"the checkpoint at step {self.step} of {cfg.steps} is in {self.last_dir}; "
                                              "rerun with --resume to continue exactly")
        if self.step >= self.stop_at and not self.head_dir.exists() and env.is_main:
            self._checkpoint_head()  # a resume of a finished run with no head/ left
        if self.eval_ds is None:
            self.notes.append("the data has no eval split: the best head was chosen on training accuracy")
        return self._report(rate)

    def _stop_early(self, queued: int) -> None:
        """Lowers ``stop_at`` after the step just read when the time budget is used up or a signal came
        (on any rank); the ``queued`` steps already launched are finished and counted."""
        cfg = self.config
        if cfg.time_budget_s and self.step < self.stop_at and self._over_budget(self.train_s):
            self.stop_at = self.step + queued
            self.notes.append(f"stopped by the time budget ({cfg.time_budget_s:g} s of training) at "
                              f"step {self.stop_at} of {cfg.steps}")
        if self.interrupt is None and self.step < self.stop_at and self._any_rank(
                self.signals is not None and self.signals.received is not None):
            self.interrupt, self.stop_at = self.signals.received or 15, self.step + queued

    def _report(self, rate: Throughput) -> TrainReport:
        env, cfg = self.env, self.config
        return TrainReport(
            out=str(self.out), head_dir=str(self.head_dir), preset=self.preset, steps=self.step,
            schedule_steps=cfg.steps, best_step=self.best_step,
            best_sim_tau=float(self.best_score) if self.best_score > -math.inf else float("nan"), tau_k=cfg.tau_k,
            final_eval=self.last_eval, train_tokens=rate.tokens, wall_s=time.perf_counter() - self.t_start,
            train_s=rate.train_s, tokens_per_s=rate.tokens_per_s(), mfu=rate.mfu(),
            mfu_note=self.mfu_note, world_size=env.world_size, global_batch=self.global_batch,
            global_batch_tokens=self.global_batch_tokens,
            device=str(env.device), draft_vocab_size=self.vocab.draft_vocab_size,
            vocab_coverage=self.vocab.coverage(), resumed_from=self.resumed_from, rank=env.rank, notes=self.notes)

    def _budget_used(self) -> float:
        budget = self.config.time_budget_s
        return self.train_s / budget if budget else 0.0

    def _over_budget(self, train_s: float) -> bool:
        return self._any_rank(train_s >= self.config.time_budget_s)

    def _any_rank(self, flag: bool) -> bool:
        """Is ``flag`` true on any rank? (every rank takes the same decision: the time budget, a signal)"""
        if not self.env.distributed:  # no device tensor, no synchronisation on one process
            return flag
        return float(dist.all_reduce_sum(torch.tensor([float(flag)], device=self.env.device), self.env)[0]) > 0

    def objective(self) -> TTTModule | DFlashModule:
        """The head and its loss as the config sets them: TTT (kernels and attention on CUDA only), or
        DFlash's blocks."""
        cfg, cuda = self.config, self.env.device.type == "cuda"
        if cfg.drafter == "dflash":
            return DFlashModule(self.head, self.embedding, labels=cfg.dflash_labels)
        return TTTModule(self.head, self.embedding, cfg.ttt_steps, weights=self.weights, reduction="sum",
                         fused=self.fused, compile_head=cuda and cfg.compile_head,
                         attention=cfg.ttt_attention if cuda else "dense")

    def target_capture(self):
        """The features' source: the target bound for capture (its graphs sized for the config's largest
        micro-batch), or the cache's reader."""
        return self.target.feature_source(self.config.aux_layer_ids, self.vocab, self.config)

    def _steps(self, objective: nn.Module):
        """Runs optimizer steps until ``stop_at`` (which the caller may lower as it goes), yielding
        ``(launched, metrics, counted, queued, dt)`` as each step's metrics are read; ``queued``:
        the steps queued after it; ``dt``: its seconds as the host sees them, from the end of the
        step before (the host's work between steps included, whether or not it overlapped the
        device's), or from its launch after an evaluation or a checkpoint and for the first step.

        With ``run_ahead`` on one process the host queues step n+1 before it waits for step n's
        metrics, so that the device does not idle while the host prepares a batch and launches its
        kernels. Never for the first step of this call (it compiles), nor past a step that
        evaluates or checkpoints (those see every queued update applied, nothing more), nor past
        ``stop_at``, nor when the last step's time would use up the time budget.
        """
        cfg, queue, done, dt = self.config, [], None, 0.0
        ahead = cfg.run_ahead and not self.env.distributed
        while self.step < self.stop_at:
            if not queue:
                queue.append(self._launch_step(objective))
            last = self.step + len(queue)  # the number the last queued step will have
            if (ahead and dt > 0 and len(queue) == 1 and last < self.stop_at and not self._pauses_at(last)
                    and not (cfg.time_budget_s and self.train_s + dt >= cfg.time_budget_s)):
                queue.append(self._launch_step(objective))
                queue[-1].ahead = True
            launched = queue.pop(0)
            m, counted = self._finish_step(launched)
            now = time.perf_counter()
            dt, done = now - (launched.t0 if done is None else done), now
            yield launched, m, counted, len(queue), dt
            if self._pauses_at(self.step):
                done = None  # the evaluation's or the checkpoint's time is no step's

    def _pauses_at(self, step: int) -> bool:
        """Does the run evaluate or checkpoint after ``step`` on the config's schedule?"""
        return step % self.config.eval_every == 0 or step % self.config.save_every == 0

    def _launch_step(self, objective: nn.Module) -> Launched:
        """Queues one optimizer step. The loss positions are found on the host and travel with the
        batch, and the metrics start their way back behind the step: on one process with a graphed
        or dense target the host waits for nothing here (ranks exchange their counts first)."""
        env, cfg = self.env, self.config
        t0 = time.perf_counter()
        micro, index = [], []
        for _ in range(cfg.grad_accum):
            micro.append(self.cursor.next().cut(cfg.max_length))
            index.append(self._positions(micro[-1], self.cursor.state()))
        epoch = self.cursor.epoch  # the epoch of this step's last micro-batch, as the step reads it
        counted = torch.tensor([[len(b) for b, _ in ix] for ix in index], dtype=torch.long).sum(0)  # [steps]
        pairs = sum(flops.causal_pairs(b.attention_mask.sum(1).tolist()) for b in micro)  # attention pairs
        both = dist.all_reduce_sum(torch.cat([counted, torch.tensor([pairs])]), env)  # over the global batch
        counted, pairs = both[:-1], int(both[-1])  # [steps], scalar
        scale = float(env.world_size)  # DDP averages gradients over ranks; the loss is a global mean
        weights = [w * scale / max(int(n), 1) for w, n in zip(self.weights, counted.tolist())]
        sums = StepSums(cfg.draft_steps)
        self.head.train()
        for j, (batch, ix) in enumerate(zip(micro, index)):
            tokens = int(batch.attention_mask.sum())
            batch = batch.to(env.device, non_blocking=True)
            ix = [(to_device(b, env.device, True), to_device(t, env.device, True)) for b, t in ix]
            captured = self.capture.features(batch)
            sync = j == len(micro) - 1 or not env.distributed
            with (contextlib.nullcontext() if sync else objective.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                    out = objective(captured.aux, batch.input_ids, batch.loss_mask, captured.teacher,
                                    batch.attention_mask, weights, ix)
                out.loss.backward()
            sums.add(out, tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(),
                                                   cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()  # a non-finite step is never saved: the check below stops the run first
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums.stage(grad_norm.reshape(1))
        return Launched(sums, counted, pairs, lr, epoch, t0)

    def _finish_step(self, launched: Launched) -> tuple[dict[str, Any], torch.Tensor]:
        """Reads a queued step's metrics (the host waits for that step only) and counts it."""
        sums = launched.sums
        sums.reduce(self.env)
        grad_norm = float(sums.extra[0])
        m = sums.metrics(self.weights, self.config.tau_k)
        if not math.isfinite(m["loss"]) or not math.isfinite(grad_norm):
            what = "loss" if not math.isfinite(m["loss"]) else "gradient norm"
            raise UserError(f"non-finite {what} at step {self.step + 1}: training stopped, the last good checkpoint "
                            f"in {self.last_dir} is intact (lower lr, or check the target and the data)")
        self.step += 1
        self.window.merge(sums)
        m.update(step=self.step, epoch=launched.epoch, lr=launched.lr, grad_norm=round(grad_norm, 6),
                 attn_pairs=launched.pairs)
        return m, launched.counted

    @torch.no_grad()
    def _evaluate(self, bar: Bar) -> None:
        env, cfg = self.env, self.config
        if self.eval_ds is None:
            m = self.window.metrics(self.weights, cfg.tau_k)
            self.window = StepSums(cfg.draft_steps)
            self._maybe_best(m, bar, source="train")
            return
        head = self.head.eval()
        n = len(self.eval_ds) if cfg.eval_examples is None else min(cfg.eval_examples, len(self.eval_ds))
        lengths = self.eval_ds.lengths[:n]
        order = sorted(range(n), key=lambda i: (min(int(lengths[i]), cfg.max_length), i))  # less padding
        g = cfg.batch_size * env.world_size
        sums = StepSums(cfg.draft_steps)
        for start in range(0, n, g):
            idx = order[start: start + g][env.rank::env.world_size]
            if not idx:
                continue
            batch = self.eval_ds.collate(idx, self.cursor.pad).cut(cfg.max_length).to(env.device)
            captured = self.capture.features(batch)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                if cfg.drafter == "dflash":
                    out = dflash_loss(head, self.embedding, captured.aux, batch.input_ids, batch.loss_mask,
                                      captured.teacher, batch.attention_mask, self.weights, reduction="sum",
                                      agree_map=True, labels=cfg.dflash_labels)
                else:
                    out = ttt_loss(head, self.embedding, captured.aux, batch.input_ids, batch.loss_mask,
                                   captured.teacher, batch.attention_mask, steps=cfg.ttt_steps, weights=self.weights,
                                   reduction="sum", agree_map=True)
            sums.add(out, int(batch.attention_mask.sum()))
            walk = walked_accept_len(out.agree, batch.loss_mask, batch.attention_mask, cfg.tau_k)
            sums.walk += torch.tensor([walk.tokens, walk.rounds])
        sums.reduce(env)
        head.train()
        self._maybe_best(sums.metrics(self.weights, cfg.tau_k), bar, source="eval")

    def _maybe_best(self, m: dict[str, Any], bar: Bar, source: str) -> None:
        m = {"type": "eval", "source": source, "step": self.step, **m, "train_s": round(self.train_s, 3)}
        better = m["sim_tau_k"] > self.best_score
        m["best"] = better
        self.last_eval = m
        if better:
            self.best_score, self.best_step = m["sim_tau_k"], self.step
            dist.barrier(self.env)
            if self.env.is_main:
                self._checkpoint_head()
            dist.barrier(self.env)
        if self.env.is_main:
            self._log(m)
            bar.log(f"step {self.step}: {source} loss {m['loss']:.4f}, acc0 {m['per_step_acc'][0]:.3f}, "
                    f"simulated tau@{self.config.tau_k} {m['sim_tau_k']:.3f}"
                    + (f", walked {m['walk_tau_k']:.3f}" if "walk_tau_k" in m else "") + (" (best)" if better else ""))

    # -- files ----------------------------------------------------------------------------------

    def _prepare_out(self) -> None:
        dev = self.env.device
        self.log = logs.open_run(self.out, self.report_to, None if self.resume_state is None else self.step, {
            "config": self.config.to_dict(), "preset": self.preset, "target": self.target_name, "data": self.data,
            "init": self.init, "world_size": self.env.world_size, "global_batch": self.global_batch,
            "global_batch_tokens": self.global_batch_tokens, "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "head_config": self.head.config.to_dict(), "draft_vocab": self.vocab.summary()})
        if self.resume_state is not None:
            if self.changed:  # a deliberate change, on the record
                self._log({"type": "resume", "step": self.step, "changed": self.changed})
            print(same_run.resumed_line(self.out, self.step, self.config.steps, self.identity, self.changed),
                  file=sys.stderr)

    def _log(self, record: dict[str, Any]) -> None:
        self.log.write(record)

    def _head_extra(self) -> dict[str, Any]:
        best = self.best_score if self.best_score > -math.inf else None
        return {"head_config": self.head.config.to_dict(), "draft_vocab": self.vocab.summary(),
                "training": {"step": self.step, "best_step": self.best_step, "sim_tau_k": best,
                             "tau_k": self.config.tau_k, "data": self.data, "preset": self.preset}}

    def _save_head(self, directory: Path) -> None:
        if self.config.drafter == "dflash":  # the engines' DFlash layout, float32
            write_dflash(self.head, directory, self.target_name, dtype="float32", extra=self._head_extra())
        else:
            save_head(self.head, directory, target=self.target_name, extra=self._head_extra())

    def _checkpoint_head(self) -> None:
        self._save_head(self.head_dir)

    def _checkpoint(self) -> None:
        dist.barrier(self.env)
        if self.env.is_main:
            state = {
                "format": checkpoint.STATE_FORMAT, "version": checkpoint.STATE_VERSION, "step": self.step,
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": checkpoint.rng_state(), "position": self.cursor.state(), "config": self.config.to_dict(),
                "preset": self.preset, "best_step": self.best_step, "best_score": self.best_score,
                "last_eval": self.last_eval, "world_size": self.env.world_size, "target": self.target_name,
                "data": self.data, "vocab_fingerprint": self.vocab.fingerprint(), "train_s": self.train_s,
                "identity": self.identity,
                "window": self.window.state(),
            }
            readable = {k: state[k] for k in ("format", "version", "step", "position", "best_step", "world_size",
                                              "target", "data", "vocab_fingerprint", "identity")}
            readable["best_sim_tau_k"] = self._head_extra()["training"]["sim_tau_k"]
            checkpoint.write_state(self.last_dir, state, self._save_head, self.vocab, readable)
        dist.barrier(self.env)
