"""MoE layer forward+backward against transformers' MixtralSparseMoeBlock (issue 10).

    python benchmarks/moe.py [--batch 8] [--seq 512] [--d-model 64] [--d-ff 96] [--experts 8]
                             [--top-k 2] [--threads 2] [--repeats 20]

Both layers hold the same weights (gate.weight = router.weight, gate_up_proj = [W_1; W_3],
down_proj = W_2) and see the same fp32 input x (B, n, d_model) and output gradient. One call =
forward, then backward into x and every weight. Each is warmed up, then the `--repeats` rounds run
both once per round (interleaved, so a busy machine slows both alike); medians are quoted.
ratio = ours / Mixtral for time (lower is better; target <= 0.75). Peak memory is the extra peak of
one call in torch's CPU allocator (see benchmarks/attention.py, `extra_peak_bytes`).

With `--train-steps N` it also trains, through `plainformer train` on the bundled corpus with the
`default` recipe, the `moe` preset and the dense `default` preset (the same active FFN size per
token): N steps each, then the `moe` preset again for the dense run's wall time (`--max-time`). It
reports training tokens/s (ratio = moe / dense, higher is better) and the final validation losses at
equal steps and at equal wall time. Minutes per run at the moe recipe's N = 400; 0 skips it.
Output: a table on stdout, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plainformer as pf
from attention import extra_peak_bytes, median_times
from plainformer import recipes

WARMUP_STEPS = recipes.get("moe").train.warmup_steps
ONE_DAY_S = 86_400


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--d-ff", type=int, default=96)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--train-steps", type=int, default=0, help="also train moe vs default for N steps")
    args = parser.parse_args(argv)
    if min(args.batch, args.seq, args.d_model, args.d_ff, args.experts, args.top_k, args.repeats) < 1:
        parser.error("all sizes and --repeats must be positive")
    if args.train_steps and args.train_steps <= WARMUP_STEPS:
        parser.error(f"--train-steps must be 0 or more than the recipe's {WARMUP_STEPS} warmup steps")
    if args.top_k > args.experts:
        parser.error("--top-k must be at most --experts")
    return args


def layer_pair(args: argparse.Namespace) -> tuple[pf.MoEFeedForward, MixtralSparseMoeBlock]:
    ours = pf.MoEFeedForward(args.d_model, args.d_ff, args.experts, args.top_k)
    config = MixtralConfig(hidden_size=args.d_model, intermediate_size=args.d_ff,
                           num_local_experts=args.experts, num_experts_per_tok=args.top_k)
    peer = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        peer.gate.weight.copy_(ours.router.weight)
        peer.experts.gate_up_proj.copy_(torch.cat([ours.W_1, ours.W_3], dim=1))
        peer.experts.down_proj.copy_(ours.W_2)
    return ours, peer


def make_call(layer: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> Callable[[], None]:
    inputs = (x, *layer.parameters())

    def call() -> None:
        torch.autograd.grad(layer(x), inputs, grad_out)

    return call


def train_run(preset: str, out: Path, *options: str) -> dict:
    """`plainformer train --preset PRESET` in a fresh process -> its final JSON line."""
    command = [sys.executable, "-m", "plainformer", "train", "--preset", preset, "--out", str(out),
               "--no-progress", *options]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def compare_training(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        # The default recipe fits its steps to a time budget; here it runs the given steps instead.
        dense = train_run("default", Path(tmp) / "dense", "--max-steps", str(steps), "--no-fit-to-time",
                          "--max-time", str(ONE_DAY_S))
        moe = train_run("moe", Path(tmp) / "moe", "--max-steps", str(steps))
        moe_timed = train_run("moe", Path(tmp) / "moe-timed", "--max-steps", str(100 * steps),
                              "--max-time", str(dense["elapsed_s"]), "--decay-steps", str(steps))
    return {"steps": steps, "dense_tokens_per_s": dense["tokens_per_s"], "moe_tokens_per_s": moe["tokens_per_s"],
            "dense_val_loss": dense["val_loss"], "moe_val_loss": moe["val_loss"],
            "moe_val_loss_equal_time": moe_timed["val_loss"], "moe_steps_equal_time": moe_timed["step"],
            "dense_parameters": dense["parameters"], "moe_parameters": moe["parameters"],
            "wall_s": dense["elapsed_s"]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours, peer = layer_pair(args)
    x = torch.randn(args.batch, args.seq, args.d_model, requires_grad=True)
    grad_out = torch.randn_like(x)
    with torch.no_grad():
        max_diff = (ours(x) - peer(x)).abs().max().item()
    calls = {"ours": make_call(ours, x, grad_out), "mixtral": make_call(peer, x, grad_out)}
    seconds = median_times(calls, args.repeats)
    peaks = {name: extra_peak_bytes(call) for name, call in calls.items()}
    ratio = seconds["ours"] / seconds["mixtral"]
    print(f"# fwd+bwd, B={args.batch} n={args.seq} d_model={args.d_model} d_ff={args.d_ff} "
          f"E={args.experts} K={args.top_k} fp32, {torch.get_num_threads()} threads, median of "
          f"{args.repeats}; ratio = ours / mixtral (time); max |ours - mixtral| = {max_diff:.1e}",
          file=sys.stderr)
    print(f"{'what':<22} {'ours ms':>9} {'mixtral ms':>11} {'ratio':>6} {'ours MiB':>9} {'mixtral MiB':>12}")
    print(f"{'MoE layer fwd+bwd':<22} {1e3 * seconds['ours']:>9.2f} {1e3 * seconds['mixtral']:>11.2f} "
          f"{ratio:>6.2f} {peaks['ours'] / 2**20:>9.1f} {peaks['mixtral'] / 2**20:>12.1f}")
    training = compare_training(args.train_steps) if args.train_steps else None
    if training:
        t = training
        print(f"{'training':<22} {'moe':>9} {'dense':>11} {'ratio':>6}")
        print(f"{'tokens/s':<22} {t['moe_tokens_per_s']:>9.0f} {t['dense_tokens_per_s']:>11.0f} "
              f"{t['moe_tokens_per_s'] / t['dense_tokens_per_s']:>6.2f}")
        print(f"{'val loss, ' + str(t['steps']) + ' steps':<22} {t['moe_val_loss']:>9.4f} {t['dense_val_loss']:>11.4f}")
        print(f"{'val loss, ' + format(t['wall_s'], '.0f') + ' s':<22} {t['moe_val_loss_equal_time']:>9.4f} "
              f"{t['dense_val_loss']:>11.4f}   (moe: {t['moe_steps_equal_time']} steps)")
    print(json.dumps({"benchmark": "moe", "batch": args.batch, "seq": args.seq, "d_model": args.d_model,
                      "d_ff": args.d_ff, "experts": args.experts, "top_k": args.top_k,
                      "threads": torch.get_num_threads(), "repeats": args.repeats,
                      "ours_ms": 1e3 * seconds["ours"], "mixtral_ms": 1e3 * seconds["mixtral"],
                      "time_ratio": ratio, "ours_peak_mib": peaks["ours"] / 2**20,
                      "mixtral_peak_mib": peaks["mixtral"] / 2**20, "max_abs_diff": max_diff,
                      "training": training}))


if __name__ == "__main__":
    main()
