"""Where a training step's time goes, op by op, for the recipes' GPTs, ours against nanoGPT's (issue 38).

    python benchmarks/profile_step.py [--shapes nanogpt-cpu default-3x128 6x384] [--dtype fp32|bf16]
                                      [--steps 10] [--rounds 3] [--top 12] [--nanogpt DIR]
                                      [--variants qk-norm bigram ...]

One step is what the trainer does: forward with targets (under bf16 autocast with --dtype bf16), backward,
gradient clipping at the recipe's grad_clip, the recipe's optimizer step (AdamW, fused; Muon for the
default), zero_grad, on the bundled Shakespeare characters' first training batches. In fp32 the linear
layers multiply on the kernels `train` measures fastest on this CPU (`training.kernels`), as `train` does.
Shapes, each with its recipe's model and TrainConfig:
  nanogpt-cpu    4 x 128, d_ff 512, batch 12 x 64, AdamW
  default-3x128  the default recipe's 3 x 128 shape (SwiGLU, RMSNorm, rotary), batch 16 x 128, Muon
  6x384          shakespeare-char's 6 x 384 without dropout, batch 8 x 256 (its recipe's 64 rows are
                 minutes a step here), AdamW
With `--nanogpt DIR` (a checkout of https://github.com/karpathy/nanoGPT, imported from there at run time,
never copied here), nanoGPT's `model.GPT` of the same shape (its GELU/LayerNorm/learned-position block: no
twin of the default's) is profiled alike with the optimizer its `configure_optimizers` builds on a CPU.

torch.profiler records `--steps` steps after three of warm-up, in `--rounds` rounds that alternate the models
(a busy machine slows both alike); each model's fastest round is kept. Every op's self time is put in one group
(matmul, attention, activation, norm, embedding and loss, optimizer and clipping, elementwise, the rest),
printed in ms per step and as a share of the step's wall time, with the matmuls' rate (model FLOPs per step,
6·N·tokens + 12·L·d·T·tokens, over their time) and ours / nanoGPT per group; then the `--top` ops by self
time. The profiler's own cost is in the times, alike for both models. Output: tables, then one JSON line.

`--variants NAME ...` (benchmarks/ablate_default.py's variants, e.g. `qk-norm "value residual"`) adds a row per
variant: the default-3x128 shape with that variant's changes, profiled against the plain default-3x128 model
in the same alternating rounds, so that the ratio is the variant's step cost (issue 49).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import plainformer as pf
from ablate_default import VARIANTS
from plainformer import recipes
from plainformer.memory import keep_freed_memory
from plainformer.training.config import TrainConfig
from plainformer.training.kernels import ATEN, choose_kernels, chosen_kernels
from plainformer.training.optim import make_optimizer
from plainformer.training.precision import matmul_rate
from train_gpt import flops_per_step, import_nanogpt, training_step

# name -> (GPT preset and its changes, recipe, rows per batch)
SHAPES: dict[str, tuple[str, dict[str, Any], str, int]] = {
    "nanogpt-cpu": ("nanogpt-cpu", {}, "nanogpt-cpu", 12),
    "default-3x128": ("default", dict(recipes.get("default").shapes[-1].model), "default", 16),
    "6x384": ("shakespeare-char", dict(dropout=0.0), "shakespeare-char", 8),
}

# Each op's self time goes to the first group one of whose name fragments its name holds.
GROUPS: dict[str, tuple[str, ...]] = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "_linear_pointwise", "aten::_mkldnn"),
    "attention": ("scaled_dot_product", "flash_attention", "softmax"),
    "activation": ("gelu", "silu", "relu", "tanh"),
    "norm": ("layer_norm", "rms_norm", "norm_backward"),
    "embedding and loss": ("embedding", "index_select", "index_add", "nll_loss", "log_softmax", "cross_entropy"),
    "optimizer and clipping": ("adam", "Optimizer", "foreach", "lerp", "addcdiv", "addcmul", "clip", "linalg",
                               "aten::norm", "sqrt"),
    "elementwise": ("aten::add", "aten::mul", "aten::div", "aten::sub", "aten::copy_", "aten::fill_", "aten::zero_",
                    "aten::sum", "aten::neg", "aten::pow", "aten::rsqrt", "aten::mean", "aten::cat", "aten::where",
                    "aten::_to_copy", "aten::clone", "aten::cos", "aten::sin"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=10, help="steps profiled per model")
    parser.add_argument("--rounds", type=int, default=3, help="profiled rounds per model, the fastest kept")
    parser.add_argument("--top", type=int, default=12, help="ops listed by self time")
    parser.add_argument("--nanogpt", type=Path, default=None, help="a nanoGPT checkout to profile its model too")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=[],
                        help="ablate_default's variants of the default shape, each against the default-3x128 model")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.top < 0:
        parser.error("--steps and --rounds must be >= 1, --top >= 0")
    if args.nanogpt is not None and not (args.nanogpt / "model.py").is_file():
        parser.error(f"--nanogpt {args.nanogpt}: no model.py there (give a nanoGPT checkout)")
    return args


def group_of(name: str) -> str:
    return next((group for group, fragments in GROUPS.items() if any(f in name for f in fragments)), "the rest")


def nanogpt_model(directory: Path, config: pf.GPTConfig) -> torch.nn.Module:
    """nanoGPT's `model.GPT` of `config`'s shape, from the checkout `directory`."""
    nanogpt = import_nanogpt(directory)
    return nanogpt.GPT(nanogpt.GPTConfig(block_size=config.block_size, vocab_size=config.vocab_size,
                                         n_layer=config.n_layers, n_head=config.n_heads, n_embd=config.d_model,
                                         dropout=0.0, bias=config.bias)).train()


def cycling_loss(batches: list[dict[str, torch.Tensor]]) -> Callable[[torch.nn.Module], torch.Tensor]:
    """loss_of(model): the loss on the next of `batches`, round and round."""
    batch = itertools.cycle(batches)
    return lambda model: model(**next(batch))[1]


def fastest_profiles(steps_of: dict[str, Callable[[], float]], steps: int, rounds: int) -> dict[str, Any]:
    """Each model's fastest of `rounds` profiles, the models alternating (the first goes first in even rounds)."""
    for step in steps_of.values():
        for _ in range(3):
            step()
    best: dict[str, Any] = {}
    for round_ in range(rounds):
        for who in (list(steps_of) if round_ % 2 == 0 else list(steps_of)[::-1]):
            profiled = profile_steps(steps_of[who], steps)
            if who not in best or profiled["wall_ms"] < best[who]["wall_ms"]:
                best[who] = profiled
    return best


def profile_steps(step: Callable[[], float], steps: int) -> dict[str, Any]:
    """ms per step by group and the ops by self time, over `steps` profiled steps."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - start
    ops = [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in prof.key_averages()
           if e.self_cpu_time_total > 0]
    groups: dict[str, float] = collections.defaultdict(float)
    for name, ms, _ in ops:
        groups[group_of(name)] += ms
    return {"wall_ms": wall * 1e3 / steps, "groups_ms": dict(groups), "ops_per_step": sum(c for *_, c in ops),
            "ops": sorted(ops, key=lambda op: -op[1])}


def measure(name: str, args: argparse.Namespace, data: pf.LMData, variant: str | None = None) -> dict[str, Any]:
    """`name`'s shape profiled (against nanoGPT's model with --nanogpt), or with `variant` the default shape with
    that variant's changes against the plain default shape."""
    preset, changes, recipe, rows = SHAPES[name]
    model_changes, train_changes = VARIANTS[variant] if variant else ({}, {})
    config = pf.GPTConfig.from_preset(preset, vocab_size=data.tokenizer.vocab_size, **{**changes, **model_changes})
    train: TrainConfig = recipes.get(recipe).train.replace(**train_changes)
    source = pf.LMBatchSource(data.train_tokens, data.val_tokens, config.block_size, seed=train.seed)
    batches = [source.get_batch("train", i, rows) for i in range(8)]
    bf16 = args.dtype == "bf16"
    torch.manual_seed(0)
    ours = pf.GPT(config).train()
    kernels = ATEN if bf16 else choose_kernels(ours, rows * config.block_size)[0]
    steps_of = {"ours": training_step(ours, make_optimizer(ours, train), cycling_loss(batches), bf16, train.grad_clip)}
    peer = None
    if variant:
        peer = "default"
        plain = pf.GPT(pf.GPTConfig.from_preset(preset, vocab_size=data.tokenizer.vocab_size, **changes)).train()
        steps_of[peer] = training_step(plain, make_optimizer(plain, recipes.get(recipe).train), cycling_loss(batches),
                                       bf16, train.grad_clip)
    elif args.nanogpt is not None and preset != "default":
        peer = "nanogpt"
        theirs = nanogpt_model(args.nanogpt, config)
        optimizer = theirs.configure_optimizers(train.weight_decay, train.lr, (train.beta1, train.beta2), "cpu")
        steps_of[peer] = training_step(theirs, optimizer, cycling_loss(batches), bf16, train.grad_clip)
    with chosen_kernels(ours, kernels):
        profiles = fastest_profiles(steps_of, args.steps, args.rounds)
    return {"shape": f"{name} {variant}" if variant else name, "batch": f"{rows}x{config.block_size}",
            "linear_kernels": kernels, "peer": peer, "flops_per_step": flops_per_step(ours, rows * config.block_size),
            **profiles}


def print_row(row: dict[str, Any], top: int) -> None:
    peer = row["peer"]
    ours, theirs = row["ours"], row.get(peer) if peer else None
    label = "nanoGPT" if peer == "nanogpt" else peer
    print(f"\n{row['shape']}, batch {row['batch']}: ours {ours['wall_ms']:.1f} ms per step, {ours['ops_per_step']:.0f} "
          f"ops" + (f"; {label} {theirs['wall_ms']:.1f} ms, {theirs['ops_per_step']:.0f} ops, ratio ours / {label} "
                    f"{ours['wall_ms'] / theirs['wall_ms']:.2f}x" if theirs else "")
          + ("; linear kernels " + ", ".join(f"{p} {k}" for p, k in row["linear_kernels"].items())
             if row["linear_kernels"] != ATEN else ""))
    header = f"  {'group':<24} {'ours ms':>8} {'share':>6}" + (f" {label + ' ms':>11} {'share':>6} {'ratio':>6}"
                                                                if theirs else "")
    print(header)
    for group in [*GROUPS, "the rest"]:
        mine = ours["groups_ms"].get(group, 0.0)
        line = f"  {group:<24} {mine:>8.2f} {mine / ours['wall_ms']:>6.1%}"
        if theirs:
            other = theirs["groups_ms"].get(group, 0.0)
            line += f" {other:>11.2f} {other / theirs['wall_ms']:>6.1%} " + \
                    (f"{mine / other:>5.2f}x" if other else f"{'-':>6}")
        print(line)
    matmul_s = ours["groups_ms"].get("matmul", 0.0) / 1e3
    if matmul_s:
        print(f"  ours' matmuls at {row['flops_per_step'] / matmul_s / 1e9:.0f} GFLOP/s (model FLOPs over their time)")
    print(f"  ours' top {top} ops by self time: ms per step, calls per step")
    for name, ms, calls in ours["ops"][:top]:
        print(f"    {name[:60]:<60} {ms:>8.2f} {calls:>7.0f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    keep_freed_memory()  # as `plainformer train` runs
    data = pf.prepare_lm_data(None, tokenizer="char")
    peak = matmul_rate(torch.float32 if args.dtype == "fp32" else torch.bfloat16, seconds=1.0)
    rows = [measure(name, args, data) for name in args.shapes]
    rows += [measure("default-3x128", args, data, variant) for variant in args.variants]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, the fastest of {args.rounds} "
          f"rounds of {args.steps} profiled steps per model; {args.dtype} matmul probe (1024^3) "
          f"{peak / 1e9:.0f} GFLOP/s")
    for row in rows:
        print_row(row, args.top)
    print("\nshare = of the step's wall time; ratio = ours / the peer's ms (nanoGPT's, or the plain default's for a "
          "variant; lower is better)")
    for row in rows:  # the JSON keeps each model's top ops only
        for who in ("ours", "nanogpt", "default"):
            if who in row:
                row[who]["ops"] = row[who]["ops"][:args.top]
    print(json.dumps({"benchmark": "profile_step", "dtype": args.dtype, "steps": args.steps, "rounds": args.rounds,
                      "matmul_probe_flops": peak, "rows": rows}))


if __name__ == "__main__":
    main()
