"""A whole training run against nanoGPT's own `train.py` on its CPU recipe, process against process (issue 38).

    python benchmarks/nanogpt_run.py --nanogpt DIR [--rounds 2] [--max-steps 2000]

DIR is a checkout of https://github.com/karpathy/nanoGPT that the user points to; its code is run, never
copied into this project. Both sides train the same characters: the bundled corpus as `plainformer
train` splits it (whole works held out), written for nanoGPT as `train.bin` / `val.bin` (uint16) with the
`meta.pkl` its `train.py` reads the vocabulary size from. nanoGPT runs its CPU recipe (its README, "I only
have a macbook"): `config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0`; ours `plainformer train --preset nanogpt-cpu`, the same model and
recipe (evaluation every 250 steps on 20 batches, checkpoints every 250).

Each round runs both processes one after the other (alternating who goes first), timed from spawn to exit
(imports, data, steps, evaluations, checkpoints, exit: everything a user waits for). Quoted: the median
wall of each side, the ratio ours / nanoGPT (lower is better), each side's last validation loss and our
run's own breakdown of its wall (the metrics line's `seconds`). Output: a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle  # nanoGPT's train.py reads its vocabulary size from a pickle; we only write one
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from plainformer.data.prepared import prepare_lm_data
from plainformer.training.precision import matmul_rate

NANOGPT_RECIPE = ["--device=cpu", "--compile=False", "--eval_iters=20", "--block_size=64", "--batch_size=12",
                  "--n_layer=4", "--n_head=4", "--n_embd=128", "--lr_decay_iters=2000", "--dropout=0.0"]
NANOGPT_VAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)", re.M)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout (holds train.py)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=2000)
    args = parser.parse_args(argv)
    if not (args.nanogpt / "train.py").is_file():
        parser.error(f"--nanogpt {args.nanogpt}: no train.py there")
    if args.rounds < 1 or args.max_steps < 250:
        parser.error("--rounds must be >= 1 and --max-steps >= 250")
    return args


def write_nanogpt_data(directory: Path) -> int:
    """The bundled corpus, split and encoded as `plainformer train` does, in nanoGPT's layout -> vocab size."""
    data = prepare_lm_data()
    directory.mkdir(parents=True)
    data.train_tokens.astype(np.uint16).tofile(directory / "train.bin")
    data.val_tokens.astype(np.uint16).tofile(directory / "val.bin")
    with open(directory / "meta.pkl", "wb") as file:
        pickle.dump({"vocab_size": data.tokenizer.vocab_size}, file)
    return data.tokenizer.vocab_size


def timed(command: list[str], cwd: Path) -> tuple[float, str]:
    """(wall seconds from spawn to exit, stdout) of a command that must succeed."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{' '.join(command[:3])} ... failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return wall, done.stdout


def run_nanogpt(args: argparse.Namespace, data: Path, out: Path) -> dict:
    wall, stdout = timed([sys.executable, "train.py", "config/train_shakespeare_char.py", *NANOGPT_RECIPE,
                          f"--max_iters={args.max_steps}", f"--dataset={data}", f"--out_dir={out}"],
                         cwd=args.nanogpt)
    step, val = NANOGPT_VAL.findall(stdout)[-1]
    return {"wall_s": wall, "val_loss": float(val), "step": int(step)}


def run_ours(args: argparse.Namespace, out: Path) -> dict:
    wall, stdout = timed([sys.executable, "-m", "plainformer", "train", "--preset", "nanogpt-cpu",
                          "--max-steps", str(args.max_steps), "--out", str(out), "--no-progress"], cwd=out.parent)
    metrics = json.loads(stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "val_loss": metrics["val_loss"], "step": metrics["step"],
            "seconds": metrics.get("seconds", {})}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs: dict[str, list[dict]] = {"ours": [], "nanogpt": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        vocab = write_nanogpt_data(root / "data")
        rate = matmul_rate(torch.float32, seconds=1.0)
        for round_ in range(args.rounds):
            for who in (("ours", "nanogpt") if round_ % 2 == 0 else ("nanogpt", "ours")):
                out = root / f"{who}-{round_}"
                result = run_ours(args, out) if who == "ours" else run_nanogpt(args, root / "data", out)
                runs[who].append(result)
                print(f"round {round_ + 1} {who}: {result['wall_s']:.1f} s, val loss {result['val_loss']:.4f}",
                      file=sys.stderr, flush=True)
    wall = {who: statistics.median(r["wall_s"] for r in rs) for who, rs in runs.items()}
    val = {who: statistics.median(r["val_loss"] for r in rs) for who, rs in runs.items()}
    print(f"nanoGPT's CPU recipe, {args.max_steps} steps of 12 x 64 on the bundled corpus (vocab {vocab}), "
          f"{os.cpu_count()} CPUs, fp32 matmul probe {rate / 1e9:.0f} GFLOP/s; medians of {args.rounds} rounds")
    header = f"{'run':<8} {'wall s':>8} {'val loss':>9}"
    print(header)
    print("-" * len(header))
    for who in runs:
        print(f"{who:<8} {wall[who]:>8.1f} {val[who]:>9.4f}")
    print(f"ratio ours / nanoGPT wall: {wall['ours'] / wall['nanogpt']:.3f}x (lower is better); "
          f"val loss difference {val['ours'] - val['nanogpt']:+.4f}")
    seconds = runs["ours"][-1]["seconds"]
    if seconds:
        print("our last run's wall: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    print(json.dumps({"benchmark": "nanogpt_run", "matmul_gflops": rate / 1e9, "max_steps": args.max_steps,
                      "wall_s": wall, "val_loss": val, "ratio": wall["ours"] / wall["nanogpt"], "runs": runs}))


if __name__ == "__main__":
    main()
