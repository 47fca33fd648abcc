"""GPT training throughput against Hugging Face GPT-2 of the same shape (issue 3).

    python benchmarks/train_gpt.py [--repeats 5] [--steps 5] [--shapes nanogpt-cpu 6x384] [--dtypes fp32 bf16]
                                   [--nanogpt DIR]

One training step = forward with targets, backward, AdamW update, zero_grad, on a fixed random batch.
Shapes: nanogpt-cpu (4 layers, 4 heads, d_model 128, d_ff 512, vocab 65, batch 12 x 64) and 6x384
(6 / 6 / 384, d_ff 1536, vocab 65, batch 8 x 256). Both models are GPT-2 with the same weights
(`_hf_gpt2.gpt2_pair`: learned positions, biases, tanh-GELU, LayerNorm, tied output, no dropout), so
their first losses (in the JSON line) agree. The peer is `transformers.GPT2LMHeadModel`
(attn_implementation="sdpa") with a plain `torch.optim.AdamW`; ours is `plainformer.GPT` (attention
backend "auto") with the optimizer our trainer builds by default (`training.make_optimizer`, the fused
AdamW kernel), no torch.compile; in fp32 its linear layers multiply on the kernels `train` would choose
on this CPU (`training.kernels`: aten's or oneDNN's, measured per product and on the layers' step, printed
under its row when not all aten's). fp32, and bf16 under torch.autocast on both sides. The process keeps
the memory it frees (`memory.keep_freed_memory`, as the `plainformer` command does), for every model alike.
With `--nanogpt DIR` (a checkout of https://github.com/karpathy/nanoGPT, imported from there at run time,
never copied here), nanoGPT's own `model.GPT` joins as a second peer with the same weights (its names are
GPT-2's; its GELU is the exact one where the pair's is the tanh form) and the optimizer its
`configure_optimizers` builds on a CPU (torch.optim.AdamW, not fused); ratio_nanogpt = ours / nanoGPT.

Timing: both models start from the same weights and run on identical batches in this one process. Each
is warmed up, then `--repeats` rounds each time `--steps` steps of ours and of the peer, alternating who
goes first (interleaved, so a busy machine slows both alike); medians of the rounds are quoted.
ratio = ours / peer in tokens/s (higher is better).

MFU: model FLOPs per step = 6·N·tokens + 12·L·d_model·T·tokens (the attention scores and weighted sum,
counted without causal savings as in PaLM's appendix B), N = parameters without the position table.
It is divided by the matmul throughput the script measures before and after the runs (fp32 and bf16,
square matmuls), the better of the two: a shared machine's speed drifts, and one slow probe would
flatter the MFU.
Memory: the extra peak bytes of torch's CPU allocator during one training step (activations, gradients
and temporaries beyond the weights and optimizer state; `attention.extra_peak_bytes`), untimed.
Output: a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plainformer as pf
from _hf_gpt2 import gpt2_pair
from attention import extra_peak_bytes
from plainformer.memory import keep_freed_memory
from plainformer.training.config import TrainConfig
from plainformer.training.kernels import ATEN, choose_kernels, chosen_kernels
from plainformer.training.optim import make_optimizer
from plainformer.training.precision import matmul_rate

SHAPES = {
    "nanogpt-cpu": dict(n_layers=4, n_heads=4, d_model=128, d_ff=512, vocab_size=65, block_size=64, batch=12),
    "6x384": dict(n_layers=6, n_heads=6, d_model=384, d_ff=1536, vocab_size=65, block_size=256, batch=8),
}
DTYPES = ("fp32", "bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per model")
    parser.add_argument("--steps", type=int, default=5, help="training steps per round")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--nanogpt", type=Path, default=None,
                        help="a nanoGPT checkout: add its model.GPT as a second peer")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be positive")
    if args.nanogpt is not None and not (args.nanogpt / "model.py").is_file():
        parser.error(f"--nanogpt {args.nanogpt}: no model.py there")
    return args


def import_nanogpt(directory: Path) -> Any:
    """nanoGPT's model.py, imported from the user's checkout `directory`."""
    sys.path.insert(0, str(directory))
    try:
        import model as nanogpt
    finally:
        sys.path.remove(str(directory))
    return nanogpt


def nanogpt_model(directory: Path, theirs: transformers.GPT2LMHeadModel, shape: dict) -> torch.nn.Module:
    """nanoGPT's `model.GPT` from `directory`, with the weights of the Hugging Face GPT-2 `theirs`."""
    nanogpt = import_nanogpt(directory)
    config = nanogpt.GPTConfig(block_size=shape["block_size"], vocab_size=shape["vocab_size"],
                               n_layer=shape["n_layers"], n_head=shape["n_heads"], n_embd=shape["d_model"],
                               dropout=0.0, bias=True)
    assert shape["d_ff"] == 4 * shape["d_model"], "nanoGPT's MLP is 4 x n_embd wide"
    model = nanogpt.GPT(config)
    conv1d = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
    hf = theirs.state_dict()
    model.load_state_dict({name: hf[name].t() if name.endswith(conv1d) else hf[name]
                           for name in model.state_dict() if not name.endswith(".attn.bias")}, strict=False)
    return model.train()


def matmul_peak() -> dict[str, float]:
    """The measured matmul throughput of each of DTYPES, FLOP/s."""
    return {"fp32": matmul_rate(torch.float32, seconds=1.0), "bf16": matmul_rate(torch.bfloat16, seconds=1.0)}


def training_step(model: torch.nn.Module, optimizer: Any, loss_of: Callable, bf16: bool,
                  grad_clip: float = 0.0) -> Callable[[], float]:
    """A function running one training step (clipping the gradients' norm at grad_clip when it is > 0)
    and returning its loss."""
    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(model)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def flops_per_step(model: pf.GPT, tokens: int) -> float:
    """6·N·tokens + 12·L·d_model·T·tokens, N the parameters without a learned position table."""
    config = model.config
    position = model.position.embedding.weight.numel() if config.pos_encoding == "learned" else 0
    n = model.num_parameters() - position
    return 6 * n * tokens + 12 * config.n_layers * config.d_model * config.block_size * tokens


def measure(name: str, shape: dict, dtype: str, args: argparse.Namespace) -> dict:
    ours, theirs = gpt2_pair(**{k: v for k, v in shape.items() if k != "batch"})
    ours.train(), theirs.train()
    batch, block = shape["batch"], shape["block_size"]
    # as `train` does: a float32 run's linear products on the kernels measured faster on this CPU
    kernels = choose_kernels(ours, batch * block)[0] if dtype == "fp32" else ATEN
    with chosen_kernels(ours, kernels):
        return {**_measure(ours, theirs, name, shape, dtype, args), "ours_linear_kernels": kernels}


def _measure(ours: pf.GPT, theirs: transformers.GPT2LMHeadModel, name: str, shape: dict, dtype: str,
             args: argparse.Namespace) -> dict:
    batch, block = shape["batch"], shape["block_size"]
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(shape["vocab_size"], (batch, block), generator=gen)
    targets = torch.randint(shape["vocab_size"], (batch, block), generator=gen)
    bf16 = dtype == "bf16"
    our_optimizer = make_optimizer(ours, TrainConfig())
    steps = {
        "ours": training_step(ours, our_optimizer, lambda m: m(idx, targets)[1], bf16),
        "peer": training_step(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-3),
                              lambda m: m(idx, labels=targets, shift_labels=targets).loss, bf16),
    }
    if args.nanogpt is not None:
        nanogpt = nanogpt_model(args.nanogpt, theirs, shape)
        optimizer = nanogpt.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
        steps["nanogpt"] = training_step(nanogpt, optimizer, lambda m: m(idx, targets)[1], bf16)
    first_loss = {who: step() for who, step in steps.items()}  # warm-up; also makes the optimizer state
    times: dict[str, list[float]] = {who: [] for who in steps}
    for round_ in range(args.repeats):
        for who in (list(steps) if round_ % 2 == 0 else list(steps)[::-1]):
            start = time.perf_counter()
            for _ in range(args.steps):
                steps[who]()
            times[who].append(time.perf_counter() - start)
    peaks = {who: extra_peak_bytes(step) for who, step in steps.items()}
    tokens = batch * block * args.steps
    tokens_per_s = {who: tokens / statistics.median(ts) for who, ts in times.items()}
    flops = flops_per_step(ours, batch * block) * args.steps
    nanogpt_figures = {} if args.nanogpt is None else {
        "nanogpt_tokens_per_s": tokens_per_s["nanogpt"],
        "ratio_nanogpt": tokens_per_s["ours"] / tokens_per_s["nanogpt"],
        "nanogpt_peak_mib": peaks["nanogpt"] / 2**20}
    return {"shape": name, "dtype": dtype, "batch": f"{batch}x{block}",
            "ours_tokens_per_s": tokens_per_s["ours"], "peer_tokens_per_s": tokens_per_s["peer"],
            "ratio": tokens_per_s["ours"] / tokens_per_s["peer"], **nanogpt_figures,
            "ours_tflops": flops / statistics.median(times["ours"]) / 1e12,
            "peer_tflops": flops / statistics.median(times["peer"]) / 1e12,
            "ours_peak_mib": peaks["ours"] / 2**20, "peer_peak_mib": peaks["peer"] / 2**20,
            "first_loss": first_loss, "ours_optimizer_fused": our_optimizer.defaults.get("fused")}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kept = keep_freed_memory()  # as the `plainformer` command does; every model of this process alike
    if args.threads:
        torch.set_num_threads(args.threads)
    before = matmul_peak()
    print("ours: plainformer.GPT, attention 'auto' (torch sdpa; in bf16 with <= 512 keys our math path), "
          "optimizer from training.make_optimizer (fused AdamW), no torch.compile; "
          "peer: GPT2LMHeadModel(sdpa), torch.optim.AdamW defaults (for-loop on CPU)")
    rows = [measure(name, SHAPES[name], dtype, args) for name in args.shapes for dtype in args.dtypes]
    after = matmul_peak()
    peak = {dtype: max(before[dtype], after[dtype]) for dtype in DTYPES}
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"malloc {'keeping freed memory' if kept else 'as the C library sets it'}; "
          f"measured matmul peak, the better of before / after the runs: "
          + ", ".join(f"{d} {peak[d] / 1e9:.0f} GFLOP/s ({before[d] / 1e9:.0f} / {after[d] / 1e9:.0f})"
                      for d in DTYPES))
    header = f"{'shape':<12} {'dtype':<5} {'batch':<7} {'ours tok/s':>11} {'peer tok/s':>11} " \
             f"{'ratio':>6} {'ours MFU':>9} {'peer MFU':>9} {'peak MiB ours/peer':>19}"
    print(header)
    print("-" * len(header))
    for row in rows:
        row["ours_mfu"] = row["ours_tflops"] * 1e12 / peak[row["dtype"]]
        row["peer_mfu"] = row["peer_tflops"] * 1e12 / peak[row["dtype"]]
        print(f"{row['shape']:<12} {row['dtype']:<5} {row['batch']:<7} {row['ours_tokens_per_s']:>11,.0f} "
              f"{row['peer_tokens_per_s']:>11,.0f} {row['ratio']:>5.2f}x {row['ours_mfu']:>8.1%} "
              f"{row['peer_mfu']:>8.1%} {row['ours_peak_mib']:>9.0f}/{row['peer_peak_mib']:<9.0f}")
        if row["ours_linear_kernels"] != ATEN:
            print(f"{'':<12} {'':<5} {'':<7} ours' linear kernels: "
                  + ", ".join(f"{product} {kernel}" for product, kernel in row["ours_linear_kernels"].items()))
        if "ratio_nanogpt" in row:
            print(f"{'':<12} {'':<5} {'':<7} {'nanoGPT':>11} {row['nanogpt_tokens_per_s']:>11,.0f} "
                  f"{row['ratio_nanogpt']:>5.2f}x {'':>9} {'':>9} {row['nanogpt_peak_mib']:>19.0f}")
    print("ratio = ours / peer tokens/s (higher is better); MFU against the measured matmul peak of the dtype"
          + ("; the nanoGPT line: its tokens/s and ours / nanoGPT's" if args.nanogpt else ""))
    print(json.dumps({"benchmark": "train_gpt", "threads": torch.get_num_threads(),
                      "peak_flops": peak, "peak_flops_before": before, "peak_flops_after": after,
                      "repeats": args.repeats, "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    main()
