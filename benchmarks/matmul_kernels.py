"""oneDNN's fp32 matmul against MKL's (aten) on the products of a training step (issue 38).

    python benchmarks/matmul_kernels.py [--shapes nanogpt-cpu default-3x128 default-4x256 6x384] [--repeats 30]

A linear layer y = x Wᵀ (x: rows x d_in, W: d_out x d_in) costs three products per training step:
forward x Wᵀ, the input's gradient g W and the weight's gradient gᵀ x (g: rows x d_out). For each
training shape, every linear layer of its GPT (attention's q, k, v and output, the feed-forward's
matrices, the output head) is timed in each of the three products on each kernel, in float32:
  mkl:    aten's products (`F.linear`, `torch.mm`), which run on MKL in torch's x86 CPU builds;
  onednn: oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`), the operands given as the
          transposed views that the product needs (no copies).
Each product is warmed up, then the median of `--repeats` runs is taken; a shape's figure is the sum over
its layers, ms per training step. ratio = onednn / mkl time (lower: oneDNN is faster). The largest
difference between the kernels' results, relative to the largest entry, is printed (summation order only).
Output: a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from plainformer.training.precision import matmul_rate

# name -> (rows per step, [(d_in, d_out, layers of that size)]), GPT shapes of the recipes (vocab 84).
SHAPES: dict[str, tuple[int, list[tuple[int, int, int]]]] = {
    "nanogpt-cpu": (12 * 64, [(128, 128, 4 * 4), (128, 512, 4), (512, 128, 4), (128, 84, 1)]),
    "default-3x128": (16 * 128, [(128, 128, 4 * 3), (128, 344, 2 * 3), (344, 128, 3), (128, 84, 1)]),
    "default-4x256": (16 * 128, [(256, 256, 4 * 4), (256, 688, 2 * 4), (688, 256, 4), (256, 84, 1)]),
    "6x384": (8 * 256, [(384, 384, 4 * 6), (384, 1536, 6), (1536, 384, 6), (384, 65, 1)]),
}
PRODUCTS = ("forward", "grad_input", "grad_weight")


def _onednn(a: Tensor, b_t: Tensor) -> Tensor:
    """a @ b_tᵀ on oneDNN's inner product."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, None, "none", [], "")


def products(rows: int, d_in: int, d_out: int) -> dict[str, dict[str, Callable[[], Tensor]]]:
    """product -> kernel -> a function computing it, on random operands of one layer."""
    x, weight, grad = torch.randn(rows, d_in), torch.randn(d_out, d_in), torch.randn(rows, d_out)
    return {
        "forward": {"mkl": lambda: F.linear(x, weight), "onednn": lambda: _onednn(x, weight)},
        "grad_input": {"mkl": lambda: torch.mm(grad, weight), "onednn": lambda: _onednn(grad, weight.t())},
        "grad_weight": {"mkl": lambda: torch.mm(grad.t(), x), "onednn": lambda: _onednn(grad.t(), x.t())},
    }


def median_seconds(run: Callable[[], Tensor], repeats: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, repeats: int) -> dict:
    rows, layers = SHAPES[name]
    ms = {product: {"mkl": 0.0, "onednn": 0.0} for product in PRODUCTS}
    worst = 0.0
    for d_in, d_out, count in layers:
        for product, kernels in products(rows, d_in, d_out).items():
            for kernel, run in kernels.items():
                ms[product][kernel] += count * 1e3 * median_seconds(run, repeats)
            reference = kernels["mkl"]()
            worst = max(worst, ((kernels["onednn"]() - reference).abs().max() / reference.abs().max()).item())
    return {"shape": name, "rows": rows, "ms": ms, "max_relative_difference": worst}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    rate = matmul_rate(torch.float32, seconds=1.0)
    results = [measure(name, args.repeats) for name in args.shapes]
    print(f"float32, {torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"matmul probe {rate / 1e9:.0f} GFLOP/s; ms per training step, summed over the model's linear layers")
    header = f"{'shape':<14} {'product':<12} {'mkl ms':>8} {'onednn ms':>10} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for result in results:
        best_mix = 0.0
        for product in (*PRODUCTS, "step"):
            if product == "step":
                mkl = sum(result["ms"][p]["mkl"] for p in PRODUCTS)
                onednn = sum(result["ms"][p]["onednn"] for p in PRODUCTS)
            else:
                mkl, onednn = result["ms"][product]["mkl"], result["ms"][product]["onednn"]
                best_mix += min(mkl, onednn)
            print(f"{result['shape']:<14} {product:<12} {mkl:>8.2f} {onednn:>10.2f} {onednn / mkl:>6.2f}x")
        result["best_mix_ms"] = best_mix
        print(f"{result['shape']:<14} {'best of each':<12} {'':>8} {best_mix:>10.2f} {best_mix / mkl:>6.2f}x   "
              f"(max relative difference {result['max_relative_difference']:.1e})")
    print("ratio = onednn / mkl milliseconds (lower: oneDNN faster)")
    print(json.dumps({"benchmark": "matmul_kernels", "matmul_gflops": rate / 1e9,
                      "capability": torch.backends.cpu.get_cpu_capability(), "results": results}))


if __name__ == "__main__":
    main()
