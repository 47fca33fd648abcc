"""One trainer for every model family: gradient accumulation, clipping, checkpoints that resume exactly.

A model is trainable when `model(**batch)` returns `(logits, loss)`; a batch source is anything with
`get_batch(split, index, batch_size) -> dict[str, Tensor]`, deterministic in (split, index). The
trainer draws micro-batch `index` = the global micro-batch counter, so the data position is that one
integer, and evaluates on the fixed validation batches 0 .. eval_batches-1. The update rule and the
schedules are in `optim.py`. Under torchrun each process reads its rows of the same global batches
and only rank 0 prints and writes files (`distributed.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn
from tqdm import tqdm

from ..checkpoint.average import keep_last, kept_checkpoint
from ..checkpoint.format import Checkpoint, CheckpointError, capture_rng_state, load_checkpoint, save_checkpoint
from ..config import Config
from ..files.run_lock import run_lock
from ..nn.attention import MultiHeadAttention
from ..nn.dtypes import at_least_float32
from ..nn.lora import adapter_state_names
from ..nn.modes import eval_mode
from .bookkeeping import (
    InterruptRequest,
    LogWindow,
    Phases,
    Stopwatch,
    TrainingDiverged,
    TrainingInterrupted,
    keep_metrics_until,
)
from .config import TrainConfig
from .distributed import Distributed, process_group
from .evaluation import Selection, evaluating
from .moe_stats import MoEStats, plot_expert_load
from .optim import lr_at, make_optimizer, set_lr
from .planner import StepPlanner
from .plots import plot_loss_curve
from .precision import bf16_measurement, model_width, resolve_dtype, shared_bf16_speedup, slow_bf16_warning
from .state import TrainerState
from .tensorboard import tensorboard_log


def check_trainable(model: nn.Module) -> None:
    """Refuse, before training starts, attention that would fail at its first training step: the
    "flash" backend applies no attention dropout, so a module that has some trains with another backend
    (inference with it is fine: dropout is off in eval mode)."""
    for name, module in model.named_modules():
        if isinstance(module, MultiHeadAttention) and module.backend == "flash" and module.dropout > 0:
            raise ValueError(f"{name or type(model).__name__} has backend='flash', which applies no attention "
                             f"dropout, and dropout {module.dropout}: train it with attention dropout 0 or "
                             f"backend 'auto', 'sdpa' or 'math'")


class Trainer:
    """Train `model` on batches from `source`, writing metrics.jsonl, loss.png, last/ and best/ to
    `out_dir`. `family` and `model_config` default to `model.family` and `model.config`.

    The model's initial weights are the caller's (seed before building it); `fit` seeds the torch,
    Python and numpy RNGs with `config.seed` (+ rank) for everything after (dropout, ...). With
    `resume=True` model, optimizer, schedule, step, data position and RNG states come from
    `out_dir/last`, which may have been written at another world size; `resume` may also be that
    checkpoint, already loaded (and verified) by the caller, which is then not read again. Either
    way it must hold the family and model config of the model being trained.

    best/ holds the weights of the lowest validation loss, or, given a `selection` (`evaluation.Selection`), of
    the best value of its metric (a translation's BLEU, a classifier's accuracy), which each evaluation scores.

    `adapter` (a JSON object: the LoRA config and the base model's reference) marks a LoRA run: its
    checkpoints hold only what it trains (`nn.lora.adapter_state_names`), with `adapter` in config.json,
    and it resumes only from checkpoints of the same adapter.

    The model trains as it is handed over: tuning for this CPU is the caller's, decided before the
    Trainer is built and kept with the run, as the families' `fit` does with the linear layers' kernels
    (`kernels.py`: `run_kernels`, then `chosen_kernels` around the Trainer; `kept_kernels` on a resume).

    Launched by torchrun, the trainer joins the process group (unless the caller already did, with
    `distributed.process_group()`) and leaves it when `fit` returns or raises.
    """

    def __init__(self, model: nn.Module, source: Any, config: TrainConfig, out_dir: str | os.PathLike,
                 *, family: str | None = None, model_config: Config | Mapping[str, Any] | None = None,
                 tokenizer: Any = None, resume: bool | Checkpoint = False, progress: bool = True,
                 adapter: Mapping[str, Any] | None = None, selection: Selection | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(getattr(source, "get_batch", None)):
            raise TypeError(f"source must have get_batch(split, index, batch_size), "
                            f"got {type(source).__name__}")
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        if not isinstance(resume, (bool, Checkpoint)):
            raise TypeError(f"resume must be a bool or a loaded Checkpoint, got {type(resume).__name__}")
        check_trainable(model)
        self.model, self.source, self.config = model, source, config
        self.out_dir = Path(out_dir)
        family = family or getattr(model, "family", None)
        if not isinstance(family, str):
            raise ValueError(f"family is required: {type(model).__name__} has no `family` attribute")
        self.family = family
        if model_config is None:
            model_config = getattr(model, "config", None)
        if model_config is None:
            raise ValueError(f"model_config is required: {type(model).__name__} has no `config`")
        # Through JSON, so that it compares equal to what a checkpoint holds.
        self.model_config = json.loads(json.dumps(
            model_config.to_dict() if isinstance(model_config, Config) else dict(model_config)))
        self._config_class = type(model_config) if isinstance(model_config, Config) else None
        self.tokenizer = tokenizer
        self.progress = progress
        self.selection = selection
        self.best_score: float | None = None
        self._scores: dict[str, float] = {}  # the selection's metrics at the latest evaluation
        self.adapter = None if adapter is None else json.loads(json.dumps(dict(adapter)))
        self._saved_names = None if adapter is None else adapter_state_names(model)
        self._group = contextlib.ExitStack()
        try:
            self._group.enter_context(process_group())
            self.dist = Distributed(config.parallel)
            self._setup(model, config, resume)
        except BaseException:
            self._group.close()
            raise

    def _setup(self, model: nn.Module, config: TrainConfig, resume: bool | Checkpoint) -> None:
        self._wrapped = self.dist.wrap(model)
        self.device = next(model.parameters()).device
        # Losses are summed in float32, or in float64 for a float64 model (see nn/dtypes.py).
        self._loss_dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
        self._share_bf16_measurement(config)
        # From here on (autocast, checkpoints, metrics) the config names the dtype actually used.
        dtype, self._dtype_reason = resolve_dtype(config.dtype, self.device, model_width(model))
        self._dtype_warning = slow_bf16_warning(dtype, self.device) if self.dist.is_main else None
        self.config = config = config.replace(dtype=dtype)
        # MuonWithAdamW is not an Optimizer subclass but has the interface the trainer and checkpoints use.
        self.optimizer = cast(torch.optim.Optimizer, make_optimizer(model, config))
        self._forward = torch.compile(self._wrapped) if config.compile else self._wrapped
        self.moe_stats = MoEStats(model)
        self._session_start = time.perf_counter()
        self._val_batches: list[dict[str, Tensor]] | None = None
        self._last_is_current = False  # last/ holds this step and everything logged so far
        self._saved_step: int | None = None  # the step last/ holds
        # The first step whose loss or gradient norm was not finite (-1: none), kept on the device and
        # read where the loop reads the device anyway: logging, evaluating, saving.
        self._first_nonfinite = torch.full((), -1, dtype=torch.long, device=self.device)
        self._eval_seconds = 0.0  # this session's evaluations (and saves of best/)
        self._phases = Phases()  # this session's seconds outside the steps
        self.planner = StepPlanner.from_config(config, lambda: (self._elapsed(), self._eval_seconds))
        self._set_state(TrainerState.fresh())
        if resume is True:
            resume = load_checkpoint(self.out_dir / "last")
        self._resume_rng_from = self._restore(resume) if isinstance(resume, Checkpoint) else None

    def _share_bf16_measurement(self, config: TrainConfig) -> None:
        """Under torchrun on a CPU without AMX, where a choice depends on how fast this CPU multiplies in
        bf16 (dtype "auto", the Newton–Schulz dtype of Muon, the warning of a slow bf16): rank 0 measures
        (`cpu_bf16_speedup`) and every rank takes its measurement until `fit` ends, so that the replicas
        choose alike, and as one process would."""
        if self.dist.world_size == 1 or (config.dtype == "float32" and config.optimizer != "muon"):
            return
        speedup = self.dist.from_main(lambda: bf16_measurement(self.device))
        if speedup is not None:
            self._group.enter_context(shared_bf16_speedup(speedup))

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    # ------------------------------------------------------------------------- resume

    def _restore(self, ckpt: Checkpoint) -> Checkpoint:
        """Continue from `ckpt`, once it is checked to be a checkpoint of this model with a trainer state."""
        if ckpt.adapter != self.adapter:
            raise CheckpointError(f"{ckpt.path} holds {'no' if ckpt.adapter is None else 'another'} LoRA "
                                  f"adapter ({ckpt.adapter}), not the one being trained ({self.adapter}); "
                                  "resume with the same one")
        if ckpt.family != self.family or self._completed(ckpt.model_config) != self.model_config:
            raise CheckpointError(f"{ckpt.path} holds a {ckpt.family!r} model with config {ckpt.model_config}, "
                                  f"not the {self.family!r} model with config {self.model_config} "
                                  "being trained; resume with the same model")
        if ckpt.trainer_state is None or not ckpt.has_optimizer_state:
            raise CheckpointError(f"{ckpt.path} has no trainer or optimizer state to resume from")
        state = TrainerState.from_checkpoint(ckpt)
        saved = ckpt.model_state_dict(self.model, names=self._saved_names)
        _refuse_non_finite(ckpt.path, saved)
        try:
            self.dist.load_model_state_dict(saved, strict=self._saved_names is None)
        except RuntimeError as e:
            raise CheckpointError(f"{ckpt.path} does not fit {type(self.model).__name__}: {e}") from None
        self.dist.load_optimizer_state_dict(self.optimizer, ckpt.optimizer_state_dict(self.optimizer))
        self._set_state(state)
        self._last_is_current = True
        self._saved_step = state.step
        return dataclasses.replace(ckpt, state_dict={})  # fit() still needs its RNG state, not the weights

    def _completed(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's model config with the fields added to the config class since it was written at
        their defaults (which keep the model it was trained as), so that a run written before them resumes."""
        if self._config_class is None or not set(saved) < set(self.model_config):
            return saved
        try:
            return json.loads(json.dumps(self._config_class.from_dict(saved).to_dict()))
        except (TypeError, ValueError):
            return saved  # not this class's config: refused as a different model

    def _set_state(self, state: TrainerState) -> None:
        """Stand where `state` says: at the start, or where a checkpoint left off (`_state` is its inverse)."""
        self.step, self.data_position = state.step, state.data_position
        self.best_val_loss, self.train_loss, self.val_loss = state.best_val_loss, state.train_loss, state.val_loss
        self.best_score = state.best_score
        self._elapsed_before = state.elapsed_s  # seconds of the sessions before this one
        self._evaluated_step = state.evaluated_step
        self._unlogged = state.log_window  # the log window a resumed run continues
        self.planner.planned = state.planned_steps
        if state.planned_steps is not None:
            self.config = self.config.replace(max_steps=state.planned_steps)

    def _state(self) -> TrainerState:
        """Where the run stands, as last/ and best/ keep it."""
        return TrainerState(step=self.step, data_position=self.data_position, best_val_loss=self.best_val_loss,
                            train_loss=self.train_loss, val_loss=self.val_loss, elapsed_s=self._elapsed(),
                            world_size=self.dist.world_size, evaluated_step=self._evaluated_step,
                            log_window=self._window.state(), planned_steps=self.planner.planned,
                            best_score=self.best_score)

    def _start_rng(self) -> None:
        """Ranks a resumed checkpoint has no state for (it was written by fewer) start fresh streams."""
        saved = self._resume_rng_from
        if saved is not None and self.dist.rank < saved.rng_ranks:
            saved.restore_rng_state(self.dist.rank)
        elif saved is not None or self.step == 0:
            seed = self.config.seed + self.dist.rank + self.step
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)
        self._resume_rng_from = None

    # ------------------------------------------------------------------------- one step

    def _batch(self, split: str, index: int, batch_size: int) -> dict[str, Tensor]:
        """This rank's `batch_size` rows of global batch `index`."""
        batch = self.source.get_batch(split, index, self.dist.global_batch_size(batch_size))
        batch = self.dist.rows(batch, batch_size)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _autocast(self):
        if self.config.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _train_step(self) -> tuple[Tensor, int, Tensor | None]:
        """One optimizer update over grad_accum_steps micro-batches -> (mean loss, input tokens, grad norm)."""
        cfg = self.config
        set_lr(self.optimizer, lr_at(self.step + 1, cfg))
        loss_sum = torch.zeros((), dtype=self._loss_dtype, device=self.device)
        tokens = 0
        for micro in range(cfg.grad_accum_steps):
            batch = self._batch("train", self.data_position, cfg.batch_size)
            self.data_position += 1
            with self.dist.gradient_sync(micro == cfg.grad_accum_steps - 1):
                with self._autocast():
                    _, loss = self._forward(**batch)
                (loss / cfg.grad_accum_steps).backward()
            loss_sum += at_least_float32(loss.detach())
            tokens += next(iter(batch.values())).numel() * self.dist.world_size
        grad_norm = (self.dist.local(nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
                     if cfg.grad_clip > 0 else None)
        self.optimizer.step()
        self.moe_stats.after_step()  # once per optimizer step: the router biases and the load window
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._last_is_current = False
        return loss_sum / cfg.grad_accum_steps, tokens, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches 0 .. eval_batches-1."""
        losses = self._validation_losses(self._validation_batches())
        return self.dist.mean(torch.stack(losses).mean()).item()

    @torch.no_grad()
    def _time_evaluation(self) -> float:
        """The seconds an evaluation takes, timed on a share of it, for fit_to_time's planner: the first
        ⌈eval_batches / 8⌉ validation batches after one untimed batch (which pays for a first forward in
        eval mode, or a compile), scaled to all eval_batches. Nothing is recorded."""
        batches = self._validation_batches()
        timed = batches[:math.ceil(len(batches) / 8)]
        self._validation_losses(batches[:1])
        start = time.perf_counter()
        self._validation_losses(timed)[-1].item()  # the forward passes have run when their loss is read
        return (time.perf_counter() - start) * len(batches) / len(timed)

    def _validation_batches(self) -> list[dict[str, Tensor]]:
        if self._val_batches is None:
            size = self.config.eval_batch_size or self.config.batch_size
            self._val_batches = [self._batch("val", i, size) for i in range(self.config.eval_batches)]
        return self._val_batches

    def _validation_losses(self, batches: list[dict[str, Tensor]]) -> list[Tensor]:
        with eval_mode(self.model), self._autocast():
            return [at_least_float32(self._forward(**batch)[1]) for batch in batches]

    # ------------------------------------------------------------------------- the loop

    def fit(self, on_locked: Callable[[], Any] | None = None) -> dict[str, Any]:
        """Train up to `max_steps` (or `max_time`); returns step, train_loss, val_loss, best_val_loss,
        dtype (the one trained in), tokens_per_s (input tokens per second of training steps), elapsed_s,
        stopped_by and seconds: this session's wall time by phase (steps, evaluation, checkpoints,
        logging, plots, other).
        Raises TrainingInterrupted after Ctrl-C, with `last/` saved. The run directory is locked
        meanwhile: a second run on it raises RunDirectoryBusy. `on_locked` (rank 0 only) runs once the
        lock is held, before training: to write files of the run that a refused run must not touch."""
        with self._group, run_lock(self.out_dir) if self.dist.is_main else contextlib.nullcontext():
            if on_locked is not None and self.dist.is_main:
                on_locked()
            return self._fit()

    def _fit(self) -> dict[str, Any]:
        cfg = self.config
        self._start_rng()
        if self.dist.is_main:
            print(f"dtype: {cfg.dtype} ({self._dtype_reason})", file=sys.stderr, flush=True)
            if self._dtype_warning is not None:
                print(self._dtype_warning, file=sys.stderr, flush=True)
            keep_metrics_until(self.metrics_path, self.step)
        self.model.train()
        self._session_start = time.perf_counter()
        self._phases = Phases()
        watch, window = Stopwatch(self.device), LogWindow(self.device, self._loss_dtype, **self._unlogged)
        self._window = window
        stopped_by, grad_norm = "max_steps", None
        log_path = self.metrics_path if self.dist.is_main else os.devnull
        with InterruptRequest() as interrupt, open(log_path, "a") as self._log, \
                tensorboard_log(self.out_dir, cfg.tensorboard and self.dist.is_main) as self._tensorboard, \
                tqdm(total=cfg.max_steps, initial=self.step, disable=not (self.progress and self.dist.is_main),
                     file=sys.stderr, unit="step", dynamic_ncols=True) as bar:
            while self.step < self.config.max_steps:
                if cfg.max_time is not None and self.dist.any(self._elapsed() >= cfg.max_time):
                    stopped_by = "max_time"
                    break
                watch.start()
                loss, tokens, grad_norm = self._train_step()
                self._watch_finite(loss, grad_norm)
                first_step = not window.total_tokens
                if self._pauses_after_step() or interrupt.requested or first_step:
                    watch.stop()  # window.add reads the clock after the session's first step
                window.add(loss, tokens, watch.total)
                if first_step and cfg.compile and self.dist.is_main:
                    bar.write(f"compile: the first step took {watch.total:.1f} s (torch.compile builds its kernels, "
                              "or loads those an earlier run cached)", file=sys.stderr)
                bar.update(1)
                if self.planner.step_taken(self.step):
                    watch.stop()
                    self._fit_steps_to_time(bar)
                interrupted = self.dist.any(interrupt.requested)  # all ranks stop at the same step
                if self.step % cfg.log_interval == 0 or interrupted:
                    self._log_train(window, watch.total, grad_norm, bar)
                if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self._evaluated_step != self.step:
                    self._evaluate_and_keep_best()
                if (cfg.save_interval and self.step % cfg.save_interval == 0) or interrupted:
                    self._save_last()
                if interrupted:
                    bar.close()
                    self._plot()
                    raise TrainingInterrupted(self.step, self.out_dir / "last")
            watch.stop()
            if window.steps:
                self._log_train(window, watch.total, grad_norm, bar)
            if self._evaluated_step != self.step:
                self._evaluate_and_keep_best()
            if not self._last_is_current:
                self._save_last()
        self._plot()
        seconds = self._phases.breakdown(watch.total, time.perf_counter() - self._session_start)
        return {"step": self.step, "train_loss": self.train_loss, "val_loss": self.val_loss,
                "best_val_loss": self.best_val_loss, **self._selection_metrics(), "dtype": cfg.dtype,
                "tokens_per_s": window.throughput(watch.total), "elapsed_s": self._elapsed(), "stopped_by": stopped_by,
                "seconds": seconds}

    def _fit_steps_to_time(self, bar: tqdm) -> None:
        """Set max_steps as fit_to_time's planner says (planner.py); the ranks agree on their mean."""
        plan = self.planner.plan(self.step, time_evaluation=self._time_evaluation_for_plan,
                                 agree=lambda steps: self.dist.mean(torch.tensor(steps, device=self.device)).item())
        self.config = self.config.replace(max_steps=plan.max_steps)
        bar.total = plan.max_steps
        bar.refresh()
        if self.dist.is_main:
            print(plan, file=sys.stderr, flush=True)

    def _time_evaluation_for_plan(self) -> float:
        """e for the planner: an evaluation (`_time_evaluation`) and the checkpoint one writes when it
        improves (best/), timed by writing last/ now, which the run keeps; their seconds count as evaluating
        (the planner's clock leaves them out of the steps' time). With a `selection` (no share of a scoring
        tells its cost) it times one whole evaluation, which counts as the run's evaluation at this step."""
        if self.selection is not None:
            start = time.perf_counter()
            self._evaluate_and_keep_best()  # counts its own seconds as evaluating
            return time.perf_counter() - start
        start = time.perf_counter()
        with self._phases.timing("evaluation"):
            seconds = self._time_evaluation()
        saving = time.perf_counter()
        self._save_last()
        end = time.perf_counter()
        self._eval_seconds += end - start
        return seconds + end - saving

    def _pauses_after_step(self) -> bool:
        """Whether the loop logs, evaluates or saves after the step just taken."""
        cfg, step = self.config, self.step
        return (step % cfg.log_interval == 0
                or bool(cfg.eval_interval and step % cfg.eval_interval == 0)
                or bool(cfg.save_interval and step % cfg.save_interval == 0))

    def _plot(self) -> None:
        if not self.dist.is_main:
            return
        with self._phases.timing("plots"):
            self._plot_now()

    def _plot_now(self) -> None:
        plot_loss_curve(self.metrics_path, self.out_dir / "loss.png")
        if self.moe_stats:
            plot_expert_load(self.metrics_path, self.out_dir / "expert_load.png")

    def _elapsed(self) -> float:
        """Wall-clock seconds of this run, including the sessions before a resume."""
        return self._elapsed_before + time.perf_counter() - self._session_start

    def _record(self, **values: Any) -> None:
        self._log.write(json.dumps({"step": self.step, **values}) + "\n")
        self._log.flush()
        self._tensorboard(self.step, values)

    def _watch_finite(self, loss: Tensor, grad_norm: Tensor | None) -> None:
        finite = loss.isfinite() if grad_norm is None else loss.isfinite() & grad_norm.isfinite()
        first = self._first_nonfinite
        self._first_nonfinite = torch.where((first < 0) & ~finite, torch.full_like(first, self.step), first)

    def _stop_if_diverged(self) -> None:
        """TrainingDiverged when a step since the start was not finite, on any rank (one host read)."""
        step = int(self._first_nonfinite)
        if self.dist.any(step >= 0):
            raise TrainingDiverged(step if step >= 0 else None, self._saved_step)

    def _log_train(self, window: LogWindow, train_seconds: float, grad_norm: Tensor | None,
                   bar: tqdm) -> None:
        with self._phases.timing("logging"):
            self._log_train_now(window, train_seconds, grad_norm, bar)

    def _log_train_now(self, window: LogWindow, train_seconds: float, grad_norm: Tensor | None,
                       bar: tqdm) -> None:
        self._stop_if_diverged()
        self.train_loss, tokens_per_s = window.flush(train_seconds, self.dist.mean)
        self._last_is_current = False
        lr = self.optimizer.param_groups[0]["lr"]
        extra = {} if grad_norm is None else {"grad_norm": grad_norm.item()}
        moe = self.moe_stats.flush()
        self._record(train_loss=self.train_loss, lr=lr, tokens_per_s=tokens_per_s,
                     elapsed_s=self._elapsed(), **extra, **moe)
        bar.set_postfix(loss=f"{self.train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:.0f}",
                        **({"moe_viol": f"{moe['max_violation']:.2f}"} if moe else {}))

    def _evaluate_and_keep_best(self) -> None:
        self._stop_if_diverged()
        start = time.perf_counter()
        with self._phases.timing("evaluation"):
            if self.selection is not None:
                with evaluating(self.model), self._autocast():
                    self._scores = {name: float(value) for name, value in self.selection.score(self.model).items()}
            self.val_loss = self._scores.pop("loss") if "loss" in self._scores else self.evaluate()
        self._evaluated_step, self._last_is_current = self.step, False
        self._record(val_loss=self.val_loss, **{f"val_{k}": v for k, v in self._scores.items()},
                     elapsed_s=self._elapsed())
        lowest = self.best_val_loss is None or self.val_loss < self.best_val_loss
        if lowest:
            self.best_val_loss = self.val_loss
        if self.selection is None:
            keep = lowest
        else:
            keep = self.selection.improves(self._scores[self.selection.metric], self.best_score)
            if keep:
                self.best_score = self._scores[self.selection.metric]
        if keep:
            self._save("best", with_optimizer=False)
        self._eval_seconds += time.perf_counter() - start

    def _selection_metrics(self) -> dict[str, float | None]:
        """The selection's metrics at the latest evaluation (val_bleu ...) and the best of the one choosing best/."""
        if self.selection is None:
            return {}
        best = {f"best_val_{self.selection.metric}": self.best_score}
        return {**{f"val_{k}": v for k, v in self._scores.items()}, **best}

    def _save_last(self) -> None:
        self._stop_if_diverged()
        self._save("last", with_optimizer=True)
        if self.config.keep_checkpoints:
            self._save(str(kept_checkpoint(".", self.step)), with_optimizer=False)
            if self.dist.is_main:
                keep_last(self.out_dir, self.config.keep_checkpoints)
        self._last_is_current = True
        self._saved_step = self.step

    def _save(self, name: str, *, with_optimizer: bool) -> None:
        """Every rank gathers the full state and its RNG state to rank 0, which writes the checkpoint."""
        with self._phases.timing("checkpoints"):
            self._save_now(name, with_optimizer=with_optimizer)

    def _save_now(self, name: str, *, with_optimizer: bool) -> None:
        model_state = self.dist.model_state_dict()
        if self._saved_names is not None:
            model_state = {name: model_state[name] for name in self._saved_names}
        optimizer_state = self.dist.optimizer_state_dict(self.optimizer) if with_optimizer else None
        cuda = [self.device.index or 0] if self.device.type == "cuda" and self.dist.world_size > 1 else None
        rng_states = self.dist.gather(capture_rng_state(cuda))
        if not self.dist.is_main:
            return
        save_checkpoint(
            self.out_dir / name, model=model_state, family=self.family, model_config=self.model_config,
            train_config=self.config.to_dict(), tokenizer=self.tokenizer, optimizer=optimizer_state,
            trainer_state=self._state().to_dict(), rng_states=rng_states, adapter=self.adapter)


def _refuse_non_finite(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """A CheckpointError when a weight saved in `path` is NaN or infinite (one host read)."""
    floats = [(name, t) for name, t in tensors.items() if t.is_floating_point()]
    finite = torch.stack([t.isfinite().all() for _, t in floats]).tolist() if floats else []
    bad = [name for (name, _), ok in zip(floats, finite, strict=True) if not ok]
    if bad:
        raise CheckpointError(f"{path} holds NaN or infinite weights ({', '.join(bad[:3])}): the run had "
                              "diverged; resume from a copy saved before that, or train again")
