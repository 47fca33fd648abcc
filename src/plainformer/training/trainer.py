"""One trainer for every model family: gradient accumulation, clipping, checkpoints that resume exactly.

A model is trainable when `model(**batch)` returns `(logits, loss)`; a batch source is anything with
`get_batch(split, index, batch_size) -> dict[str, Tensor]`, deterministic in (split, index). The
trainer draws micro-batch `index` = the global micro-batch counter, so the data position is that one
integer, and evaluates on the fixed validation batches 0 .. eval_batches-1. The update rule and the
schedules are in `optim.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor, nn
from tqdm import tqdm

from ..config import Config
from ..io.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from .config import TrainConfig
from .optim import lr_at, make_optimizer
from .moe_stats import MoEStats, plot_expert_load
from .plots import plot_loss_curve


class TrainingInterrupted(Exception):
    """Raised by `Trainer.fit` after Ctrl-C, once the current step finished and `last/` was saved."""

    def __init__(self, step: int, checkpoint: Path):
        super().__init__(f"training interrupted at step {step}; checkpoint saved to {checkpoint} "
                         "(continue with resume=True, or --resume on the command line)")
        self.step = step
        self.checkpoint = checkpoint


class _InterruptRequest:
    """While active, the first SIGINT only sets `requested`; a second one raises KeyboardInterrupt.
    Nothing is printed from the handler: writing to stderr there can re-enter tqdm's write."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> _InterruptRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            previous = self._previous if self._previous is not None else signal.default_int_handler
            signal.signal(signal.SIGINT, previous)


class _Stopwatch:
    """Seconds spent in training steps, leaving out evaluation, logging and checkpointing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.total = 0.0
        self._since: float | None = None

    def start(self) -> None:
        self._since = time.perf_counter()

    def stop(self) -> None:
        if self._since is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.total += time.perf_counter() - self._since
            self._since = None


class Trainer:
    """Train `model` on batches from `source`, writing metrics.jsonl, loss.png, last/ and best/ to
    `out_dir`. `family` and `model_config` default to `model.family` and `model.config`.

    The model's initial weights are the caller's (seed before building it); `fit` seeds the torch,
    Python and numpy RNGs with `config.seed` for everything after (dropout, ...). With `resume=True`
    model, optimizer, schedule, step, data position and RNG states come from `out_dir/last`.
    """

    def __init__(self, model: nn.Module, source: Any, config: TrainConfig, out_dir: str | os.PathLike,
                 *, family: str | None = None, model_config: Config | Mapping[str, Any] | None = None,
                 tokenizer: Any = None, resume: bool = False, progress: bool = True):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(getattr(source, "get_batch", None)):
            raise TypeError(f"source must have get_batch(split, index, batch_size), "
                            f"got {type(source).__name__}")
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        self.model, self.source, self.config = model, source, config
        self.out_dir = Path(out_dir)
        self.family = family or getattr(model, "family", None)
        if not isinstance(self.family, str):
            raise ValueError(f"family is required: {type(model).__name__} has no `family` attribute")
        model_config = model.config if model_config is None and hasattr(model, "config") else model_config
        if model_config is None:
            raise ValueError(f"model_config is required: {type(model).__name__} has no `config`")
        # Through JSON, so that it compares equal to what a checkpoint holds.
        self.model_config = json.loads(json.dumps(
            model_config.to_dict() if isinstance(model_config, Config) else dict(model_config)))
        self.tokenizer = tokenizer
        self.progress = progress
        self.device = next(model.parameters()).device
        self.optimizer = make_optimizer(model, config)
        self._forward = torch.compile(model) if config.compile else model
        self.moe_stats = MoEStats(model)
        self.step = 0
        self.data_position = 0
        self.best_val_loss: float | None = None
        self.train_loss: float | None = None
        self.val_loss: float | None = None
        self._elapsed_before = 0.0
        self._session_start = time.perf_counter()
        self._val_batches: list[dict[str, Tensor]] | None = None
        self._resume_rng_from = self._restore(self.out_dir / "last") if resume else None

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    # ------------------------------------------------------------------------- resume

    def _restore(self, path: Path) -> Checkpoint:
        ckpt = load_checkpoint(path)
        if ckpt.family != self.family or ckpt.model_config != self.model_config:
            raise CheckpointError(f"{path} holds a {ckpt.family!r} model with config {ckpt.model_config}, "
                                  f"not the {self.family!r} model with config {self.model_config} "
                                  "being trained; resume with the same model")
        if ckpt.trainer_state is None or not ckpt.has_optimizer_state:
            raise CheckpointError(f"{path} has no trainer or optimizer state to resume from")
        state = ckpt.trainer_state
        try:
            step, data_position = state["step"], state["data_position"]
            best_val_loss, train_loss = state["best_val_loss"], state["train_loss"]
            val_loss, elapsed_before = state["val_loss"], state["elapsed_s"]
        except KeyError as e:
            raise CheckpointError(f"{path / 'trainer_state.json'} lacks {e}") from None
        ckpt.restore_model(self.model)
        ckpt.restore_optimizer(self.optimizer)
        self.step, self.data_position = step, data_position
        self.best_val_loss, self.train_loss, self.val_loss = best_val_loss, train_loss, val_loss
        self._elapsed_before = elapsed_before
        return dataclasses.replace(ckpt, state_dict={})  # fit() still needs its RNG state, not the weights

    def _start_rng(self) -> None:
        if self._resume_rng_from is not None:
            self._resume_rng_from.restore_rng_state()
            self._resume_rng_from = None
        elif self.step == 0:
            random.seed(self.config.seed)
            np.random.seed(self.config.seed)
            torch.manual_seed(self.config.seed)

    # ------------------------------------------------------------------------- one step

    def _batch(self, split: str, index: int, batch_size: int) -> dict[str, Tensor]:
        batch = self.source.get_batch(split, index, batch_size)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _autocast(self):
        if self.config.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _train_step(self) -> tuple[Tensor, int, Tensor | None]:
        """One optimizer update over grad_accum_steps micro-batches -> (mean loss, input tokens, grad norm)."""
        cfg = self.config
        lr = lr_at(self.step + 1, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for _ in range(cfg.grad_accum_steps):
            batch = self._batch("train", self.data_position, cfg.batch_size)
            self.data_position += 1
            with self._autocast():
                _, loss = self._forward(**batch)
            (loss / cfg.grad_accum_steps).backward()
            loss_sum += loss.detach().float()
            tokens += next(iter(batch.values())).numel()
        grad_norm = (nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                     if cfg.grad_clip > 0 else None)
        self.optimizer.step()
        self.moe_stats.after_step()  # once per optimizer step: the router biases and the load window
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum / cfg.grad_accum_steps, tokens, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches 0 .. eval_batches-1."""
        if self._val_batches is None:
            size = self.config.eval_batch_size or self.config.batch_size
            self._val_batches = [self._batch("val", i, size) for i in range(self.config.eval_batches)]
        was_training = self.model.training
        self.model.eval()
        try:
            with self._autocast():
                losses = [self._forward(**batch)[1].float() for batch in self._val_batches]
        finally:
            self.model.train(was_training)
        return torch.stack(losses).mean().item()

    # ------------------------------------------------------------------------- the loop

    def fit(self) -> dict[str, Any]:
        """Train up to `max_steps` (or `max_time`); returns step, train_loss, val_loss, best_val_loss,
        tokens_per_s (input tokens per second of training steps), elapsed_s and stopped_by.
        Raises TrainingInterrupted after Ctrl-C, with `last/` saved."""
        cfg = self.config
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._start_rng()
        _keep_metrics_until(self.metrics_path, self.step)
        self.model.train()
        self._session_start = time.perf_counter()
        watch, window = _Stopwatch(self.device), _LogWindow(self.device)
        evaluated = saved = None  # the steps of this session's latest evaluation and save of last/
        stopped_by, grad_norm = "max_steps", None
        with _InterruptRequest() as interrupt, open(self.metrics_path, "a") as self._log, \
                tqdm(total=cfg.max_steps, initial=self.step, disable=not self.progress,
                     file=sys.stderr, unit="step", dynamic_ncols=True) as bar:
            while self.step < cfg.max_steps:
                if cfg.max_time is not None and self._elapsed() >= cfg.max_time:
                    stopped_by = "max_time"
                    break
                watch.start()
                loss, tokens, grad_norm = self._train_step()
                watch.stop()
                window.add(loss, tokens, watch.total)
                bar.update(1)
                if self.step % cfg.log_interval == 0 or interrupt.requested:
                    self._log_train(window, watch.total, grad_norm, bar)
                if cfg.eval_interval and self.step % cfg.eval_interval == 0:
                    evaluated = self._evaluate_and_keep_best()
                if (cfg.save_interval and self.step % cfg.save_interval == 0) or interrupt.requested:
                    saved = self._save_last()
                if interrupt.requested:
                    bar.close()
                    self._plot()
                    raise TrainingInterrupted(self.step, self.out_dir / "last")
            if window.steps:
                self._log_train(window, watch.total, grad_norm, bar)
            if evaluated != self.step:
                self._evaluate_and_keep_best()
            if saved != self.step:
                self._save_last()
        self._plot()
        return {"step": self.step, "train_loss": self.train_loss, "val_loss": self.val_loss,
                "best_val_loss": self.best_val_loss,
                "tokens_per_s": window.throughput(watch.total), "elapsed_s": self._elapsed(), "stopped_by": stopped_by}

    def _plot(self) -> None:
        plot_loss_curve(self.metrics_path, self.out_dir / "loss.png")
        if self.moe_stats:
            plot_expert_load(self.metrics_path, self.out_dir / "expert_load.png")

    def _elapsed(self) -> float:
        """Wall-clock seconds of this run, including the sessions before a resume."""
        return self._elapsed_before + time.perf_counter() - self._session_start

    def _record(self, **values: Any) -> None:
        self._log.write(json.dumps({"step": self.step, **values}) + "\n")
        self._log.flush()

    def _log_train(self, window: _LogWindow, train_seconds: float, grad_norm: Tensor | None,
                   bar: tqdm) -> None:
        self.train_loss, tokens_per_s = window.flush(train_seconds)
        lr = self.optimizer.param_groups[0]["lr"]
        extra = {} if grad_norm is None else {"grad_norm": grad_norm.item()}
        moe = self.moe_stats.flush()
        self._record(train_loss=self.train_loss, lr=lr, tokens_per_s=tokens_per_s,
                     elapsed_s=self._elapsed(), **extra, **moe)
        bar.set_postfix(loss=f"{self.train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:.0f}",
                        **({"moe_viol": f"{moe['max_violation']:.2f}"} if moe else {}))

    def _evaluate_and_keep_best(self) -> int:
        self.val_loss = self.evaluate()
        self._record(val_loss=self.val_loss, elapsed_s=self._elapsed())
        if self.best_val_loss is None or self.val_loss < self.best_val_loss:
            self.best_val_loss = self.val_loss
            self._save("best", with_optimizer=False)
        return self.step

    def _save_last(self) -> int:
        self._save("last", with_optimizer=True)
        return self.step

    def _save(self, name: str, *, with_optimizer: bool) -> Path:
        return save_checkpoint(
            self.out_dir / name, model=self.model, family=self.family, model_config=self.model_config,
            train_config=self.config.to_dict(), tokenizer=self.tokenizer,
            optimizer=self.optimizer if with_optimizer else None,
            trainer_state={"step": self.step, "data_position": self.data_position,
                           "best_val_loss": self.best_val_loss, "train_loss": self.train_loss,
                           "val_loss": self.val_loss, "elapsed_s": self._elapsed()})


class _LogWindow:
    """Loss and input tokens since the last log line. The loss stays a device tensor until it is
    logged, so the hot loop never waits on `.item()`."""

    def __init__(self, device: torch.device):
        self.loss = torch.zeros((), device=device)
        self.steps = self.tokens = self.total_tokens = 0
        self._mark = 0.0  # training seconds at the last flush
        self._after_first: tuple[int, float] | None = None  # (total_tokens, seconds) after step 1

    def add(self, loss: Tensor, tokens: int, train_seconds: float) -> None:
        self.loss += loss
        self.steps += 1
        self.tokens += tokens
        self.total_tokens += tokens
        if self._after_first is None:
            self._after_first = (self.total_tokens, train_seconds)

    def throughput(self, train_seconds: float) -> float:
        """Input tokens per training second over the session, leaving out the first step (it pays
        for torch.compile, lazy initialisation and allocator warm-up) when there are others."""
        if self._after_first is None:
            return 0.0
        first_tokens, first_seconds = self._after_first
        if self.total_tokens > first_tokens and train_seconds > first_seconds:
            return (self.total_tokens - first_tokens) / (train_seconds - first_seconds)
        return self.total_tokens / max(train_seconds, 1e-9)

    def flush(self, train_seconds: float) -> tuple[float, float]:
        """-> (mean loss per step, input tokens per training second) since the last flush."""
        mean_loss = (self.loss / self.steps).item()
        tokens_per_s = self.tokens / max(train_seconds - self._mark, 1e-9)
        self.loss.zero_()
        self.steps = self.tokens = 0
        self._mark = train_seconds
        return mean_loss, tokens_per_s


def _keep_metrics_until(path: Path, step: int) -> None:
    """Drop the lines of steps after `step` (a resumed run logs them again; a fresh run, step 0,
    starts an empty file). Rewritten atomically."""
    kept = []
    if step > 0 and path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
