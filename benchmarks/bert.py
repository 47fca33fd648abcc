"""Sentence embeddings with all-MiniLM-L6-v2: pf.SentenceEncoder against sentence-transformers (issue 6).

    python benchmarks/bert.py [--sentences 1000] [--batch-size 32] [--repeats 3]

Both encode the same `--sentences` lines of the bundled corpus (non-empty lines drawn with a fixed
seed), `--batch-size` at a time, from text to unit-norm embeddings (tokenization included), in this one
process. Each variant is warmed up on the first 64 lines, then the `--repeats` rounds run every variant
once per round (interleaved, so a busy machine slows them all alike); medians are quoted.
ratio = ours / peer in sentences per second (higher is better).

Variants: sentence-transformers in fp32 (the peer), ours in fp32, and ours under bfloat16 autocast
(compared with the fp32 peer). Memory: the extra peak bytes of torch's CPU allocator during one encode
of all the sentences, counted by the profiler as in benchmarks/attention.py (the weights, already
allocated, are not counted). Output: a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import extra_peak_bytes
from plainformer.data.corpus import load_text
from plainformer.hf.bert import minilm_path
from plainformer.hf.sentence import SentenceEncoder

WARMUP_SENTENCES = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if min(args.sentences, args.batch_size, args.repeats) < 1:
        parser.error("--sentences, --batch-size and --repeats must be positive")
    return args


def corpus_sentences(count: int) -> list[str]:
    lines = [line.strip() for line in load_text().splitlines() if line.strip()]
    return random.Random(0).sample(lines, count)


def median_seconds(calls: dict[str, Callable[[list[str]], object]], sentences: list[str],
                   repeats: int) -> dict[str, float]:
    for call in calls.values():
        call(sentences[:WARMUP_SENTENCES])
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call(sentences)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    from sentence_transformers import SentenceTransformer

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sentences = corpus_sentences(args.sentences)
    ours = SentenceEncoder.from_pretrained("minilm")
    peer = SentenceTransformer(str(minilm_path()), device="cpu")
    calls = {
        "sentence-transformers fp32": lambda s: peer.encode(s, batch_size=args.batch_size, convert_to_tensor=True),
        "plainformer fp32": lambda s: ours.encode(s, args.batch_size),
        "plainformer bf16": lambda s: ours.encode(s, args.batch_size, dtype=torch.bfloat16),
    }
    difference = (calls["plainformer fp32"](sentences) - calls["sentence-transformers fp32"](sentences)).abs().max()
    seconds = median_seconds(calls, sentences, args.repeats)
    peaks = {name: extra_peak_bytes(lambda call=call: call(sentences)) for name, call in calls.items()}
    peer_rate = args.sentences / seconds["sentence-transformers fp32"]
    print(f"# {args.sentences} corpus lines, batch {args.batch_size}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}; ratio = ours / sentence-transformers fp32 in sentences/s "
          f"(higher is better)", file=sys.stderr)
    print(f"{'what':<28} {'sentences/s':>12} {'peer/s':>10} {'ratio':>6} {'peak MiB':>9}")
    results = []
    for name in calls:
        rate = args.sentences / seconds[name]
        row = {"what": name, "sentences_per_s": rate, "seconds": seconds[name], "ratio": rate / peer_rate,
               "peak_mib": peaks[name] / 2**20}
        results.append(row)
        print(f"{name:<28} {rate:>12.1f} {peer_rate:>10.1f} {row['ratio']:>6.2f} {row['peak_mib']:>9.1f}")
    print(f"max |ours fp32 - sentence-transformers| = {difference:.2e}", file=sys.stderr)
    print(json.dumps({"benchmark": "bert", "model": "all-MiniLM-L6-v2", "sentences": args.sentences,
                      "batch_size": args.batch_size, "repeats": args.repeats,
                      "threads": torch.get_num_threads(), "max_abs_difference_fp32": difference.item(),
                      "results": results}))


if __name__ == "__main__":
    main()
