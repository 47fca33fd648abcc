"""What the Trainer adds to a bare training step at the nanogpt-cpu shape (issue 12: within 10%).

    python benchmarks/trainer_overhead.py [--repeats 5] [--steps 10] [--threads 1] [--dtype float32] [--clock wall]

bare: `train_gpt.py`'s step (forward with targets, backward, fused AdamW, zero_grad, loss.item()) on one
fixed batch. trainer: one iteration of `Trainer.fit`'s loop, measured as the time between the starts of
consecutive `_train_step` calls, so it holds everything the loop does per step (drawing and moving the
batch, the schedule, clipping at the recipe's grad_clip, the loss window, logging every log_interval
steps, the progress bar off). "trainer, no clip" is the same with grad_clip 0, to show what clipping
costs. Both models start from the same weights; rounds alternate who goes first (interleaved, so a busy
machine slows all alike); the median and the best of the per-round medians are quoted (on a loaded
machine the best round is the steadier figure).
ratio = variant / bare in seconds per step, median rounds and best rounds (lower is better; 1.10 is
the issue's limit). `--clock cpu`
times with the process's CPU time instead of the wall clock: on a machine shared with other jobs it
leaves out the time other processes hold the cores (meaningful with --threads 1).
Output: a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plainformer as pf
from plainformer import recipes
from plainformer.training.config import TrainConfig
from plainformer.training.optim import make_optimizer
from train_gpt import SHAPES, training_step

SHAPE = SHAPES["nanogpt-cpu"]
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per variant")
    parser.add_argument("--steps", type=int, default=10, help="training steps per round")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 2:
        parser.error("--repeats must be >= 1 and --steps >= 2")
    return args


def nanogpt_cpu_model() -> pf.GPT:
    """train_gpt.py's model at the nanogpt-cpu shape (GPT-2 layout: learned positions, biases, tied)."""
    torch.manual_seed(0)
    return pf.GPT(pf.GPTConfig(vocab_size=SHAPE["vocab_size"], block_size=SHAPE["block_size"],
                               n_layers=SHAPE["n_layers"], n_heads=SHAPE["n_heads"], d_model=SHAPE["d_model"],
                               d_ff=SHAPE["d_ff"], dropout=0.0, bias=True, activation="gelu_tanh",
                               pos_encoding="learned", norm="layernorm", tie_weights=True))


class TrainerRounds:
    """Runs `Trainer.fit` `steps` steps further per round; returns the loop's seconds per step."""

    def __init__(self, model: pf.GPT, config: TrainConfig, out_dir: Path):
        tokens = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=200_000)
        source = pf.LMBatchSource(tokens[:180_000], tokens[180_000:], SHAPE["block_size"], seed=1)
        self.trainer = pf.Trainer(model, source, config, out_dir, progress=False)
        self.starts: list[float] = []
        step = self.trainer._train_step

        def timed_step():
            self.starts.append(clock())
            return step()

        self.trainer._train_step = timed_step

    def __call__(self, steps: int) -> float:
        self.starts.clear()
        trainer = self.trainer
        trainer.config = trainer.config.replace(max_steps=trainer.step + steps + 1)
        trainer.fit()  # the final evaluation and save come after the last start: not timed
        return statistics.median(np.diff(self.starts))


def bare_rounds(model: pf.GPT, bf16: bool):
    gen = torch.Generator().manual_seed(1)
    shape = (SHAPE["batch"], SHAPE["block_size"])
    idx, targets = (torch.randint(SHAPE["vocab_size"], shape, generator=gen) for _ in range(2))
    step = training_step(model, make_optimizer(model, TrainConfig()), lambda m: m(idx, targets)[1], bf16)

    def run(steps: int) -> float:
        times = []
        for _ in range(steps):
            start = clock()
            step()
            times.append(clock() - start)
        return statistics.median(times)

    return run


def main(argv: list[str] | None = None) -> None:
    global clock
    args = parse_args(argv)
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    recipe = recipes.get("nanogpt-cpu").train.replace(
        batch_size=SHAPE["batch"], dtype=args.dtype, eval_interval=0, save_interval=0, eval_batches=1)
    model = nanogpt_cpu_model()
    with tempfile.TemporaryDirectory() as tmp:
        variants = {
            "bare step (train_gpt.py)": bare_rounds(copy.deepcopy(model), args.dtype == "bfloat16"),
            "trainer": TrainerRounds(copy.deepcopy(model), recipe, Path(tmp) / "a"),
            "trainer, no clip": TrainerRounds(copy.deepcopy(model), recipe.replace(grad_clip=0.0),
                                              Path(tmp) / "b"),
        }
        for run in variants.values():
            run(2)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in variants}
        order = list(variants)
        for round_ in range(args.repeats):
            for name in order[round_ % len(order):] + order[:round_ % len(order)]:
                times[name].append(variants[name](args.steps))
    bare = statistics.median(times["bare step (train_gpt.py)"])
    best = min(times["bare step (train_gpt.py)"])
    rows = [{"variant": name, "ms_per_step": 1e3 * statistics.median(ts), "ratio": statistics.median(ts) / bare,
             "best_ms_per_step": 1e3 * min(ts), "best_ratio": min(ts) / best} for name, ts in times.items()]
    print(f"nanogpt-cpu shape, batch {SHAPE['batch']}x{SHAPE['block_size']}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, {args.repeats} rounds of {args.steps} steps, {args.clock} clock")
    header = f"{'variant':<26} {'ms/step':>9} {'ratio':>7} {'best ms/step':>13} {'best ratio':>11}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['variant']:<26} {row['ms_per_step']:>9.2f} {row['ratio']:>6.3f}x "
              f"{row['best_ms_per_step']:>13.2f} {row['best_ratio']:>10.3f}x")
    print("ratio = variant / bare seconds per step (lower is better)")
    print(json.dumps({"benchmark": "trainer_overhead", "dtype": args.dtype, "clock": args.clock,
                      "threads": torch.get_num_threads(),
                      "repeats": args.repeats, "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    main()
