"""Learning per second on the `default` shape: variants of the default recipe at equal wall time or steps.

    python benchmarks/ablate_default.py [--budget-s 300 | --steps N] [--shape 3x128] [--seeds 0 1]
                                        [--variants default ... | --round issue-49] [--list]

Each variant is the GPT `default` preset (model shape and training recipe) with a few GPTConfig or
TrainConfig fields changed. Variants run one at a time, on the bundled Shakespeare characters, each
for the same wall-time budget, max_time = budget with the recipe's fit_to_time: the trainer times the
variant's steps, plans the steps that end by the budget (and plans again halfway), so that each cosine
schedule has annealed when its time is up. Evaluation happens only for the plan and at the end
(eval_interval 0), on the recipe's fixed validation batches, and is counted in the budget.
With `--steps N` every variant trains N steps instead (its schedule ends there): changes that leave the
step's cost alone (a schedule, a rate) then compare without the machine's speed drifting between runs.
`--shape` starts every variant from one of the recipe's shapes (docs/guide.md, "Choosing the default") rather than
the preset's 4 x 256.
The figure of merit is the validation loss at the end (lower is better) on every token of the validation split
(the trainer's own estimate, on the recipe's 40 batches, is printed too); tokens/s is the trainer's.
Every variant starts from the recipe's seed, or runs once per seed given (`--seeds 0 1`: the seed alone
moved the default's loss on its own 40 batches by 0.01-0.02, as much as most changes, and by 0.002-0.007 on the
whole split) and is ranked by its mean.
Output: a table, then one JSON line.
A variant naming a field the configs do not have, or a value they refuse (e.g. a feature not built yet), is
reported, not run.
`--round NAME` runs the variants of a round (ROUNDS), "default" first, as the baseline they compare with.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import plainformer as pf
from plainformer import recipes
from plainformer.memory import keep_freed_memory
from plainformer.training.config import TrainConfig
from plainformer.training.evaluation import validation_loss
from plainformer.training.kernels import chosen_kernels, run_kernels

# name -> (GPTConfig changes, TrainConfig changes), all relative to the `default` preset.
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "default": ({}, {}),
    "muon": ({}, dict(optimizer="muon")),
    "muon lr 0.05": ({}, dict(optimizer="muon", muon_lr=0.05)),
    "muon lr 0.01": ({}, dict(optimizer="muon", muon_lr=0.01)),
    "lr 1e-3": ({}, dict(lr=1e-3)),
    "lr 4e-3": ({}, dict(lr=4e-3)),
    "batch 8": ({}, dict(batch_size=8)),
    "batch 32": ({}, dict(batch_size=32)),
    "narrow deep 6x192": (dict(n_layers=6, n_heads=4, d_model=192, d_ff=512), {}),
    "wide shallow 3x320": (dict(n_layers=3, n_heads=5, d_model=320, d_ff=864), {}),
    "block 64": (dict(block_size=64), {}),
    "block 256": (dict(block_size=256), {}),
    "untied head": (dict(tie_weights=False), {}),
    "qk-norm": (dict(qk_norm=True), {}),
    "lr floor 4e-4": ({}, dict(min_lr=4e-4)),
    # The second round: Muon's best rate in the first, combined with the other changes that did well.
    "muon lr 0.005": ({}, dict(optimizer="muon", muon_lr=0.005)),
    "muon 0.01 batch 32": ({}, dict(optimizer="muon", muon_lr=0.01, batch_size=32)),
    "muon 0.01 3x320": (dict(n_layers=3, n_heads=5, d_model=320, d_ff=864), dict(optimizer="muon", muon_lr=0.01)),
    "muon 0.01 lr 4e-3": ({}, dict(optimizer="muon", muon_lr=0.01, lr=4e-3)),
    "muon 0.01 batch 32 fp32": ({}, dict(optimizer="muon", muon_lr=0.01, batch_size=32, dtype="float32")),
    # The third round, after the faster steps of RMSNorm, RoPE and Muon: what the cheaper layers buy.
    "layernorm": (dict(norm="layernorm"), {}),
    "learned positions": (dict(pos_encoding="learned"), {}),
    "layernorm learned": (dict(norm="layernorm", pos_encoding="learned"), {}),
    "batch 16": ({}, dict(batch_size=16)),
    "batch 24": ({}, dict(batch_size=24)),
    "float32": ({}, dict(dtype="float32")),
    "bfloat16": ({}, dict(dtype="bfloat16")),
    # The fourth round, on an AVX2-only CPU (fp32, Newton-Schulz a quarter of the step): cheaper steps.
    "adamw": ({}, dict(optimizer="adamw")),
    "4x192": (dict(d_model=192, d_ff=512), {}),
    "4x192 batch 8": (dict(d_model=192, d_ff=512), dict(batch_size=8)),
    "3x192": (dict(n_layers=3, d_model=192, d_ff=512), {}),
    "4x128": (dict(d_model=128, d_ff=344), {}),
    "6x128": (dict(n_layers=6, d_model=128, d_ff=344), {}),
    "4x160": (dict(d_model=160, d_ff=432), {}),
    "4x192 muon 0.03": (dict(d_model=192, d_ff=512), dict(muon_lr=0.03)),
    "4x192 batch 12": (dict(d_model=192, d_ff=512), dict(batch_size=12)),
    "3x160": (dict(n_layers=3, d_model=160, d_ff=432), {}),
    "3x192 batch 12": (dict(n_layers=3, d_model=192, d_ff=512), dict(batch_size=12)),
    "2x256": (dict(n_layers=2), {}),
    "3x128": (dict(n_layers=3, d_model=128, d_ff=344), {}),
    "2x128": (dict(n_layers=2, d_model=128, d_ff=344), {}),
    "3x96": (dict(n_layers=3, d_model=96, d_ff=256), {}),
    # The `moe` preset's model (8 experts of half the width, 2 active) in the default's recipe (issue 23):
    # at the default's 200 s, and for the steps the dense 4 x 256 fits in them on an AVX2-only CPU.
    "moe": (dict(d_ff=344, n_experts=8, top_k=2), {}),
    "moe 240 steps": (dict(d_ff=344, n_experts=8, top_k=2), dict(fit_to_time=False, max_time=None, max_steps=240)),
    # The fifth round (issue 38), on a Zen 4 AMD whose bf16 matmuls run at 1.9x fp32's: 3 x 128 in bf16 fits
    # 2,000-2,500 steps in 200 s, twice what the recipe was tuned for; more tokens per step, or a longer context.
    "3x128 batch 24": (dict(n_layers=3, d_model=128, d_ff=344), dict(batch_size=24)),
    "3x128 batch 32": (dict(n_layers=3, d_model=128, d_ff=344), dict(batch_size=32)),
    "3x128 block 256": (dict(n_layers=3, d_model=128, d_ff=344, block_size=256), {}),
    # The sixth round (issue 38), at the step counts the 3 x 128 shape fits in 200 s (`--shape 3x128 --steps N`):
    # the schedule's end; "seed 1" measures what the seed alone moves.
    "seed 1": ({}, dict(seed=1)),
    "cosine to zero": ({}, dict(min_lr=0.0)),
    "linear": ({}, dict(schedule="linear")),
    "linear to zero": ({}, dict(schedule="linear", min_lr=0.0)),
    # The seventh round (issue 38), `--shape 3x128 --steps 1200 --seeds 0 1`: the rates and the regularisers, tuned
    # at 4 x 256 or at fewer steps before, on the 3 x 128 shape at its step counts (with "lr 4e-3" and "untied head").
    "muon lr 0.03": ({}, dict(muon_lr=0.03)),
    "muon lr 0.04": ({}, dict(muon_lr=0.04)),
    "no weight decay": ({}, dict(weight_decay=0.0)),
    "beta2 0.95": ({}, dict(beta2=0.95)),
    "no grad clip": ({}, dict(grad_clip=0.0)),
    "warmup 10": ({}, dict(warmup_steps=10)),
    "weight decay 0.2": ({}, dict(weight_decay=0.2)),
    "muon lr 0.015": ({}, dict(muon_lr=0.015)),
    # The eighth round (issue 49): the block variants of the speedruns, each alone on the default, to run as
    # `--round issue-49 --budget-s 200 --seeds 0 1` and `--round issue-49 --steps N --seeds 0 1` (N: the default's
    # steps in 200 s). The attention ones (qk_norm, attn_softcap, alibi, sliding_window) are reported as
    # skipped on a branch without their fields. ReLU² replaces SwiGLU at its d_ff (fewer parameters, a cheaper
    # step) and at d_ff 512, the issue's transplant (3 x 128's SwiGLU parameters); zero_init needs an untied
    # head, so "untied head" is its baseline too.
    "relu2": (dict(activation="relu2"), {}),
    "relu2 d_ff 512": (dict(activation="relu2", d_ff=512), {}),
    "logit softcap 30": (dict(logit_softcap=30.0), {}),
    "logit softcap 15": (dict(logit_softcap=15.0), {}),
    "zero init": (dict(zero_init=True, tie_weights=False), {}),
    "embed norm": (dict(embed_norm=True), {}),
    "x0 mix": (dict(x0_mix=True), {}),
    "value residual": (dict(value_residual=True), {}),
    "token shift": (dict(token_shift=True), {}),
    "bigram": (dict(bigram_embedding=True), {}),
    "attn softcap 30": (dict(attn_softcap=30.0), {}),
    "attn softcap 15": (dict(attn_softcap=15.0), {}),
    "alibi": (dict(pos_encoding="alibi"), {}),
    "sliding window 64": (dict(sliding_window=64), {}),
    "sliding window 32": (dict(sliding_window=32), {}),
    # The ninth round: the four that beat the default at 600 equal steps on both seeds (docs/experiments.md),
    # together, at equal wall time.
    "issue-49 winners": (dict(qk_norm=True, sliding_window=64, bigram_embedding=True, value_residual=True), {}),
    # The tenth: the winners less QK-norm, whose step costs 1.3x the default's in bf16 (profile_step --variants)
    # where the other three cost 0.97-1.04x: at their cost, equal steps are equal wall time within a few percent.
    "issue-49 cheap winners": (dict(sliding_window=64, bigram_embedding=True, value_residual=True), {}),
    # The eleventh, after the windowed math path lost its softmax guard (1.12x the default's step for the four):
    # the four and the two soft-caps that were within the noise alone, at equal wall time.
    "issue-49 winners capped": (dict(qk_norm=True, sliding_window=64, bigram_embedding=True, value_residual=True,
                                     attn_softcap=30.0, logit_softcap=30.0), {}),
    # modded-nanogpt's block as the issue lists it, all at once: a reference for the round that combines winners.
    "speedrun block": (dict(activation="relu2", d_ff=512, qk_norm=True, zero_init=True, tie_weights=False,
                            embed_norm=True, value_residual=True, x0_mix=True, logit_softcap=15.0), {}),
}

# name -> the variants it runs, in order (after "default", which every round runs first).
ROUNDS: dict[str, list[str]] = {
    "issue-49": ["relu2", "relu2 d_ff 512", "qk-norm", "attn softcap 30", "attn softcap 15", "logit softcap 30",
                 "logit softcap 15", "alibi", "sliding window 64", "sliding window 32", "untied head", "zero init",
                 "embed norm", "x0 mix", "value residual", "token shift", "bigram", "speedrun block"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=300.0, help="wall-time budget per variant")
    parser.add_argument("--steps", type=int, default=None,
                        help="train every variant this many steps instead of for --budget-s")
    parser.add_argument("--shape", choices=[shape.name for shape in recipes.get("default").shapes], default=None,
                        help="start every variant from this shape of the default recipe")
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None)
    runs.add_argument("--round", choices=list(ROUNDS), default=None,
                      help="the variants of this round, after the default")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run each variant once per seed (TrainConfig.seed) and rank by the mean")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--list", action="store_true", help="print the variants and exit")
    args = parser.parse_args(argv)
    if not args.budget_s > 0:
        parser.error("--budget-s must be > 0")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.variants is None:
        args.variants = ["default", *ROUNDS[args.round]] if args.round else list(VARIANTS)
    return args


def missing_fields(changes: dict[str, Any], config_cls: type) -> list[str]:
    names = {f.name for f in dataclasses.fields(config_cls)}
    return sorted(set(changes) - names)


def train(model_config: pf.GPTConfig, train_config: TrainConfig, data: pf.LMData, out_dir: Path) -> dict:
    source = pf.LMBatchSource(data.train_tokens, data.val_tokens, model_config.block_size,
                              seed=train_config.seed)
    torch.manual_seed(train_config.seed)
    model = pf.GPT(model_config)
    kernels, _ = run_kernels(model, train_config, source, out_dir)  # as `train` measures a float32 run's
    with chosen_kernels(model, kernels):
        metrics = pf.Trainer(model, source, train_config, out_dir, tokenizer=data.tokenizer, progress=False).fit()
    # The recipe's 40 validation batches are drawn with the run's seed and batch size, so they differ between
    # seeds and batch sizes; every token of the split (in float32) compares any two runs on the same text.
    whole_split, _ = validation_loss(model, data.val_tokens, model_config.block_size, train_config.batch_size)
    return {**metrics, "parameters": model.num_parameters(), "whole_split_val_loss": whole_split}


def length_fields(budget_s: float, steps: int | None) -> dict[str, Any]:
    """The TrainConfig fields that end a variant's run: after `steps`, or at the budget's end."""
    if steps is not None:
        return dict(max_steps=steps, max_time=None, fit_to_time=False)
    return dict(max_time=budget_s, fit_to_time=True)


def run_variant(name: str, data: pf.LMData, length: dict[str, Any], shape: dict[str, Any], tmp: Path,
                seed: int | None = None) -> dict:
    model_changes, train_changes = VARIANTS[name]
    model_changes = {**shape, **model_changes}
    if seed is not None:
        train_changes = {**train_changes, "seed": seed}
    row: dict[str, Any] = {"variant": name, "changes": {**model_changes, **train_changes}}
    missing = missing_fields(model_changes, pf.GPTConfig) + missing_fields(train_changes, TrainConfig)
    if missing:
        return {**row, "skipped": f"no field {', '.join(missing)}"}
    try:  # a value the field does not take yet (pos_encoding="alibi" before it is built) is reported too
        model_config = pf.GPTConfig.from_preset("default", vocab_size=data.tokenizer.vocab_size, **model_changes)
        recipe = recipes.get("default").train.replace(**{
            **dict(eval_interval=0, save_interval=0, **length), **train_changes})
    except ValueError as error:
        return {**row, "skipped": str(error)}
    start = time.perf_counter()
    metrics = train(model_config, recipe, data, tmp / (name if seed is None else f"{name} seed {seed}"))
    return {**row, "steps": metrics["step"], "tokens_per_s": metrics["tokens_per_s"],
            "val_loss": metrics["val_loss"], "whole_split_val_loss": metrics["whole_split_val_loss"],
            "train_loss": metrics["train_loss"], "dtype": metrics["dtype"],
            "stopped_by": metrics["stopped_by"], "parameters": metrics["parameters"],
            "wall_s": time.perf_counter() - start}


def print_table(rows: list[dict], *, seeded: bool) -> None:
    header = (f"{'variant':<20} {'seed':>4} " if seeded else f"{'variant':<20} ") + \
        f"{'steps':>6} {'tokens/s':>9} {'val loss':>9} {'whole split':>11} {'dtype':>9} {'stopped by':>11}"
    print(header)
    print("-" * len(header))
    for row in rows:
        name = f"{row['variant']:<20} {row['changes'].get('seed', ''):>4}" if seeded else f"{row['variant']:<20}"
        if "skipped" in row:
            print(f"{name} skipped: {row['skipped']}")
            continue
        print(f"{name} {row['steps']:>6} {row['tokens_per_s']:>9,.0f} {row['val_loss']:>9.4f} "
              f"{row['whole_split_val_loss']:>11.4f} {row['dtype']:>9} {row['stopped_by']:>11}")


def print_means(rows: list[dict]) -> None:
    """Each variant's whole-split validation loss over its seeds: mean, and the spread the seeds gave."""
    losses: dict[str, list[float]] = {}
    for row in rows:
        if "skipped" not in row:
            losses.setdefault(row["variant"], []).append(row["whole_split_val_loss"])
    print(f"{'variant':<20} {'seeds':>5} {'mean whole split':>17} {'min':>7} {'max':>7}")
    for name, values in sorted(losses.items(), key=lambda item: sum(item[1]) / len(item[1])):
        print(f"{name:<20} {len(values):>5} {sum(values) / len(values):>17.4f} {min(values):>7.4f} {max(values):>7.4f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.list:
        for name, (model_changes, train_changes) in VARIANTS.items():
            print(f"{name:<20} {json.dumps({**model_changes, **train_changes})}")
        return
    keep_freed_memory()  # as `plainformer train` runs
    if args.threads:
        torch.set_num_threads(args.threads)
    data = pf.prepare_lm_data(None, tokenizer="char")
    shape = next((s.model for s in recipes.get("default").shapes if s.name == args.shape), {})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            for seed in args.seeds or [None]:
                print(f"running {name}{'' if seed is None else f' (seed {seed})'} ...", file=sys.stderr, flush=True)
                rows.append(run_variant(name, data, length_fields(args.budget_s, args.steps), dict(shape),
                                        Path(tmp), seed))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # a later variant's failure keeps it
    per_variant = f"{args.steps} steps" if args.steps else f"{args.budget_s:g} s of training"
    print(f"default preset ({args.shape or 'its own shape'}) on Shakespeare characters, {per_variant} per variant, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print_table(rows, seeded=args.seeds is not None)
    print(f"val loss at equal {'steps' if args.steps else 'wall time'} (lower is better)")
    if args.seeds is not None:
        print_means(rows)
    print(json.dumps({"benchmark": "ablate_default", "budget_s": args.budget_s, "steps": args.steps,
                      "shape": args.shape, "seeds": args.seeds,
                      "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
