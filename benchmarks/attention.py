"""Attention backends against torch: forward+backward time and extra peak memory (issues 2 and 4).

    python benchmarks/attention.py [--sizes 512 1024 ...] [--repeats 3] [--causal both|yes|no]

For every sequence length n (B=1, H=8, d=64, fp32 by default) and causal or not, the peer is torch's
`F.scaled_dot_product_attention` and ours are `plainformer.attention(q, k, v, backend=...)` with the
"math" (step by step), "sdpa" (our wrapper of torch's fused kernel) and "flash" (our FlashAttention)
backends. One call = forward plus backward of all three gradients (torch.autograd.grad with a fixed
random output gradient).

Time: all functions run on identical inputs in this one process; each is warmed up once, then the
`--repeats` rounds run every function once per round (interleaved, so a busy machine slows them all
alike), and the median per function is quoted. ratio = ours / torch (lower is better).

Memory: the extra peak of one call, i.e. the most bytes live at once in torch's CPU allocator during
the call beyond the inputs already allocated (outputs and gradients included). It is read from
`torch.profiler.profile(profile_memory=True)`: every allocation and free is recorded in time order,
and the running sum of their sizes gives the peak. This counts exactly the tensors the algorithm
creates, independent of malloc caching or other processes (unlike RSS). It is a separate, untimed
call, as the profiler slows the run. mem ratio = ours / torch.

The math backend stores the (B, H, n, n) scores several times (about 5 fp32 copies in
forward+backward); where that estimate exceeds `--math-limit-gib` the row says "skipped".
Output: a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import plainformer as pf

MATH_SCORE_COPIES = 5
OURS = ("math", "sdpa", "flash")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+",
                        default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--backends", nargs="+", choices=OURS, default=list(OURS))
    parser.add_argument("--math-limit-gib", type=float, default=6.0,
                        help="skip the math backend when its scores would need more than this")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.repeats < 1 or min(args.sizes) < 1:
        parser.error("--repeats and --sizes must be positive")
    return args


def make_call(backend: str | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              grad_out: torch.Tensor, is_causal: bool) -> Callable[[], None]:
    """Forward + backward of one backend; None is torch's own F.scaled_dot_product_attention."""
    def call() -> None:
        if backend is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        else:
            out = pf.attention(q, k, v, is_causal=is_causal, backend=backend)
        torch.autograd.grad(out, (q, k, v), grad_out)

    return call


def extra_peak_bytes(call: Callable[[], None]) -> int:
    """Most bytes live at once during `call` beyond what was live before it.

    The profiler records every allocation (+bytes) and free (-bytes) of torch's CPU allocator as a
    "[memory]" event; their running sum in time order is the live memory, its maximum the peak.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        call()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def median_times(calls: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure(n: int, is_causal: bool, args: argparse.Namespace) -> list[dict]:
    gen = torch.Generator().manual_seed(n)
    shape = (args.batch, args.heads, n, args.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_() for _ in range(3))
    grad_out = torch.randn(shape, generator=gen)
    score_bytes = args.batch * args.heads * n * n * 4
    skipped = {}
    if "math" in args.backends and MATH_SCORE_COPIES * score_bytes > args.math_limit_gib * 2**30:
        skipped["math"] = f"needs ~{MATH_SCORE_COPIES * score_bytes / 2**30:.0f} GiB"
    calls = {"torch": make_call(None, q, k, v, grad_out, is_causal)}
    calls.update({b: make_call(b, q, k, v, grad_out, is_causal)
                  for b in args.backends if b not in skipped})
    seconds = median_times(calls, args.repeats)
    peaks = {name: extra_peak_bytes(call) for name, call in calls.items()}
    rows = []
    for name in ["torch", *args.backends]:
        row = {"n": n, "causal": is_causal, "what": name}
        if name in skipped:
            row["skipped"] = skipped[name]
        else:
            row.update(ms=1e3 * seconds[name], time_ratio=seconds[name] / seconds["torch"],
                       peak_mib=peaks[name] / 2**20,
                       mem_ratio=peaks[name] / peaks["torch"] if peaks["torch"] else None)
        rows.append(row)
    return rows


def format_row(row: dict, torch_ms: float) -> str:
    head = f"{row['n']:>6} {('yes' if row['causal'] else 'no'):>6} {row['what']:>6}"
    if "skipped" in row:
        return f"{head}  skipped: {row['skipped']}"
    mem_ratio = "-" if row["mem_ratio"] is None else f"{row['mem_ratio']:.2f}"
    return (f"{head} {row['ms']:>10.1f} {torch_ms:>10.1f} {row['time_ratio']:>6.2f} "
            f"{row['peak_mib']:>10.1f} {mem_ratio:>8}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    print(f"# forward+backward, B={args.batch} H={args.heads} d={args.head_dim} fp32, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}; ratio = ours / torch",
          file=sys.stderr)
    print(f"{'n':>6} {'causal':>6} {'what':>6} {'ms':>10} {'torch ms':>10} {'ratio':>6} "
          f"{'peak MiB':>10} {'mem ratio':>8}")
    results = []
    for n in args.sizes:
        for is_causal in causal:
            rows = measure(n, is_causal, args)
            torch_ms = rows[0]["ms"]
            for row in rows:
                print(format_row(row, torch_ms), flush=True)
            results.extend(rows)
    print(json.dumps({"benchmark": "attention", "batch": args.batch, "heads": args.heads,
                      "head_dim": args.head_dim, "dtype": "float32", "repeats": args.repeats,
                      "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
