"""Data-parallel scaling on CPUs and FSDP2's memory per rank (issue 11).

    python benchmarks/distributed.py [--shapes default 6x384] [--repeats 5] [--steps 3] [--world 2]

Throughput: GPT training steps at one global batch, fp32, on the same total number of cores:
W processes x 1 thread each (gloo, DDP, each rank its rows of the global batch) against 1 process x W
threads. One step = the rows of global micro-batch i (`Distributed.rows`), forward, backward
(gradients all-reduced), clipping, fused AdamW: the trainer's own step without its logging.
Scaling efficiency = tokens/s of W x 1 / tokens/s of 1 x W (1.0: the processes lose nothing to the
all-reduce; the target is >= 0.9 at 6x384).

Memory: per rank, the bytes of parameters + gradients + optimizer state each process holds (local
shards under FSDP2: about 1/W of DDP's), and the process's peak resident set size (ru_maxrss, which
includes the Python interpreter and torch), for DDP and FSDP2 at the largest shape given.

Shapes: default = the GPT `default` preset (4 / 4 / 256, d_ff 688, RoPE, RMSNorm, SwiGLU, block 128,
global batch 16); 6x384 = 6 / 6 / 384, d_ff 1536, block 256, global batch 8. Vocabulary 65.
Each configuration runs in fresh processes started with torch.multiprocessing (spawn, loopback);
each times `--repeats` rounds of `--steps` steps after one warm-up step; medians of the rounds.
Output: a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from plainformer.data.lm import LMBatchSource
from plainformer.models.gpt import GPT, GPTConfig
from plainformer.training.config import TrainConfig
from plainformer.training.distributed import Distributed, process_group
from plainformer.training.optim import make_optimizer

SHAPES = {
    "default": dict(model=dict(GPTConfig.PRESETS["default"], vocab_size=65), batch=16),
    "6x384": dict(model=dict(vocab_size=65, block_size=256, n_layers=6, n_heads=6, d_model=384, d_ff=1536),
                  batch=8),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per configuration")
    parser.add_argument("--steps", type=int, default=3, help="training steps per round")
    parser.add_argument("--world", type=int, default=2, help="processes (and threads of the 1-process run)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or args.world < 2:
        parser.error("--repeats and --steps must be positive, --world at least 2")
    if args.world > os.cpu_count():
        parser.error(f"--world {args.world} exceeds the {os.cpu_count()} CPUs")
    return args


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer state this process holds (local shards)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local(v) for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors)


def _worker(rank: int, world: int, threads: int, port: int, job: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    shape = SHAPES[job["shape"]]
    config = GPTConfig(**shape["model"])
    global_batch = shape["batch"]
    with process_group(timeout_s=300):
        distributed = Distributed(job["parallel"])
        torch.manual_seed(0)
        model = GPT(config)
        wrapped = distributed.wrap(model)
        optimizer = make_optimizer(model, TrainConfig())
        tokens = torch.randint(0, config.vocab_size, (200_000,)).numpy()
        source = LMBatchSource(tokens, tokens[:10_000], config.block_size)
        batch_size = global_batch // world
        position = 0

        def step() -> None:
            nonlocal position
            batch = distributed.rows(source.get_batch("train", position, global_batch), batch_size)
            position += 1
            _, loss = wrapped(**batch)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # keep the gradients counted in the memory figure

        step()
        times = []
        for _ in range(job["repeats"]):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            for _ in range(job["steps"]):
                step()
            if world > 1:
                dist.barrier()
            times.append(time.perf_counter() - start)
        result = {"tokens_per_s": global_batch * config.block_size * job["steps"] / statistics.median(times),
                  "state_mib": _state_bytes(model, optimizer) / 2**20,
                  "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(shape: str, parallel: str, world: int, threads: int, args: argparse.Namespace) -> list[dict]:
    """Per-rank results of one configuration, in fresh processes."""
    job = {"shape": shape, "parallel": parallel, "repeats": args.repeats, "steps": args.steps}
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(world, threads, _free_port(), job, out), nprocs=world,
                           start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    W = args.world
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; fp32, gloo on loopback; "
          f"{W} processes x 1 thread vs 1 process x {W} threads")
    rows = []
    for shape in args.shapes:
        single = run(shape, "none", 1, W, args)[0]
        ddp = run(shape, "ddp", W, 1, args)
        rows.append({"shape": shape, "global_batch": SHAPES[shape]["batch"],
                     "one_process_tokens_per_s": single["tokens_per_s"],
                     "ddp_tokens_per_s": ddp[0]["tokens_per_s"],
                     "efficiency": ddp[0]["tokens_per_s"] / single["tokens_per_s"],
                     "ddp_state_mib": ddp[0]["state_mib"], "ddp_max_rss_mib": max(r["max_rss_mib"] for r in ddp)})
    header = f"{'shape':<8} {'batch':>5} {f'1x{W} tok/s':>11} {f'{W}x1 tok/s':>11} {'efficiency':>10}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['shape']:<8} {row['global_batch']:>5} {row['one_process_tokens_per_s']:>11,.0f} "
              f"{row['ddp_tokens_per_s']:>11,.0f} {row['efficiency']:>10.2f}")
    print(f"efficiency = ({W} processes x 1 thread tokens/s) / (1 process x {W} threads tokens/s), "
          "higher is better")

    shape = args.shapes[-1]
    fsdp = run(shape, "fsdp", W, 1, args)
    ddp_row = rows[-1]
    memory = {"shape": shape, "ddp_state_mib": ddp_row["ddp_state_mib"],
              "fsdp_state_mib": max(r["state_mib"] for r in fsdp),
              "ddp_max_rss_mib": ddp_row["ddp_max_rss_mib"],
              "fsdp_max_rss_mib": max(r["max_rss_mib"] for r in fsdp),
              "fsdp_tokens_per_s": fsdp[0]["tokens_per_s"]}
    memory["state_ratio"] = memory["fsdp_state_mib"] / memory["ddp_state_mib"]
    print(f"\nmemory per rank at {shape}, {W} ranks     DDP      FSDP2   FSDP2/DDP")
    print(f"params + grads + AdamW state MiB  {memory['ddp_state_mib']:>8.1f} {memory['fsdp_state_mib']:>9.1f}"
          f" {memory['state_ratio']:>10.2f}   (1/{W} = {1 / W:.2f})")
    print(f"peak resident set MiB             {memory['ddp_max_rss_mib']:>8.0f} {memory['fsdp_max_rss_mib']:>9.0f}")
    print(f"FSDP2 tokens/s {memory['fsdp_tokens_per_s']:,.0f} vs DDP {ddp_row['ddp_tokens_per_s']:,.0f}")
    print(json.dumps({"benchmark": "distributed", "world": W, "repeats": args.repeats, "steps": args.steps,
                      "rows": rows, "memory": memory}))


if __name__ == "__main__":
    main()
