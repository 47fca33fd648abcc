"""Streamed corpus preparation: peak resident memory and MB/s, char and byte-level BPE.

    python benchmarks/prepare.py                      # 100 MB, 1 GB and (disk allowing) 4 GB
    python benchmarks/prepare.py --sizes 5 --kinds char,bpe

For each size a corpus is generated (documents of lines of words, some non-ASCII, separated by two
blank lines) and prepared by `prepare_lm_data` in a fresh child process, so that its peak RSS
(ru_maxrss) is the preparation's own:
- char: the whole preparation (scan, split, encode), MB of the file per second;
- bpe: first the whole preparation with tokenizer training (on at most TOKENIZER_SAMPLE_CHARS), then
  the encoding alone (a given tokenizer, a fresh cache), compared with `tokenizers`' own
  `encode_batch` (and `encode_batch_fast`, which ours calls) on the same text in the same process,
  in the same chunk and group sizes, over its first --peer-mb MB: the ratio is ours / peer
  throughput (higher is better); the peer's reading is not timed, ours includes both passes.
Targets (issue 15): peak RSS <= 1 GB at every size, char >= 20 MB/s, BPE encoding >= 5 MB/s on
2 cores, BPE encoding >= 0.8x `encode_batch`. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = ("the king said and thou art a fool to be or not that is question whether tis nobler mind "
         "suffer slings arrows outrageous fortune, sea of troubles. by opposing end them: die, sleep").split()


RARE_WORDS = "été naïve café Ἀθῆναι страна 東京 über".split()  # in one line in twenty


def generate(path: Path, megabytes: int, seed: int = 0) -> None:
    """About `megabytes` MB of documents of ~35 KB, lines of 1-14 words (mostly ASCII), written in
    slabs of ~1 MB."""
    rng = np.random.default_rng(seed)
    pool = [" ".join(rng.choice(WORDS if i % 20 else WORDS + RARE_WORDS, rng.integers(1, 15)))
            for i in range(20_000)]
    target, written = megabytes * 1_000_000, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            docs = ["\n".join(pool[i] for i in rng.integers(0, len(pool), 700)) for _ in range(20)]
            slab = "\n\n\n".join(docs) + "\n\n\n"
            f.write(slab)
            written += len(slab.encode("utf-8"))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def child(path: Path, kind: str, vocab_size: int, workdir: Path, peer_mb: int) -> dict:
    """One measurement, in a process of its own (see the module docstring)."""
    from plainformer.data import prepared

    size = path.stat().st_size / 1e6
    start = time.perf_counter()
    data = prepared.prepare_lm_data(path, tokenizer=kind, vocab_size=vocab_size if kind == "bpe" else None,
                              cache_dir=workdir / f"cache-{kind}")
    result = {"kind": kind, "mb": size, "seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_mb(),
              "tokens": len(data.train_tokens) + len(data.val_tokens)}
    if kind == "bpe":
        start = time.perf_counter()
        prepared.prepare_lm_data(path, tokenizer=data.tokenizer, cache_dir=workdir / "cache-bpe-given")
        result["encode_seconds"] = time.perf_counter() - start
        result["peak_rss_mb"] = peak_rss_mb()  # ours, before the peer runs
        for method in ("encode_batch", "encode_batch_fast"):
            result[f"peer_{method}_mb_per_s"] = peer_throughput(path, data.tokenizer, method, peer_mb)
    return result


def peer_throughput(path: Path, tokenizer, method: str, peer_mb: int) -> float:
    """MB/s of `tokenizers.Tokenizer.<method>` over the file's first `peer_mb` MB, in the chunk and
    group sizes prepare uses (read time excluded)."""
    from plainformer.data import lm

    encode = getattr(tokenizer._tok, method)
    group_chars = lm.ENCODE_CHUNK_CHARS * lm.ENCODE_GROUP
    seconds, done = 0.0, 0
    with open(path, encoding="utf-8") as f:
        while done < peer_mb * 1_000_000 and (block := f.read(group_chars)):
            chunks = [block[i:i + lm.ENCODE_CHUNK_CHARS] for i in range(0, len(block), lm.ENCODE_CHUNK_CHARS)]
            start = time.perf_counter()
            encode(chunks)
            seconds += time.perf_counter() - start
            done += len(block.encode("utf-8"))
    return done / 1e6 / seconds


def run_child(path: Path, kind: str, vocab_size: int, workdir: Path, peer_mb: int) -> dict:
    argv = [sys.executable, __file__, "--child", str(path), "--kinds", kind, "--bpe-vocab-size", str(vocab_size),
            "--workdir", str(workdir), "--peer-mb", str(peer_mb)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    shutil.rmtree(workdir / f"cache-{kind}", ignore_errors=True)
    shutil.rmtree(workdir / "cache-bpe-given", ignore_errors=True)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,4000", help="corpus sizes in MB (default: %(default)s)")
    parser.add_argument("--kinds", default="char,bpe")
    parser.add_argument("--bpe-vocab-size", type=int, default=4096)
    parser.add_argument("--peer-mb", type=int, default=200, help="MB the peer encodes (default: %(default)s)")
    parser.add_argument("--workdir", type=Path, help="where corpora and caches go (default: a temporary folder)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.kinds, args.bpe_vocab_size, args.workdir, args.peer_mb)))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="plainformer-prepare-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for megabytes in map(int, args.sizes.split(",")):
            if shutil.disk_usage(workdir).free < 3 * megabytes * 1_000_000:
                print(f"skipping {megabytes} MB: not enough free disk in {workdir}", file=sys.stderr)
                continue
            path = workdir / f"corpus-{megabytes}MB.txt"
            generate(path, megabytes)
            for kind in args.kinds.split(","):
                rows.append(run_child(path, kind, args.bpe_vocab_size, workdir, args.peer_mb))
            path.unlink()
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(rows)
    print(json.dumps({"benchmark": "prepare", "cpus": os.cpu_count(), "results": rows}))


def print_table(rows: list[dict]) -> None:
    print(f"{'what':<44} {'ours MB/s':>10} {'peer MB/s':>10} {'ratio':>6} {'peak RSS MB':>12}")
    for r in rows:
        name = f"{r['kind']} prepare, {r['mb']:.0f} MB" + (" (with training)" if r["kind"] == "bpe" else "")
        print(f"{name:<44} {r['mb'] / r['seconds']:>10.2f} {'':>10} {'':>6} {r['peak_rss_mb']:>12.0f}")
        if r["kind"] == "bpe":
            ours = r["mb"] / r["encode_seconds"]
            for method in ("encode_batch", "encode_batch_fast"):
                peer = r[f"peer_{method}_mb_per_s"]
                name = f"bpe encoding, {r['mb']:.0f} MB vs {method}"
                print(f"{name:<44} {ours:>10.2f} {peer:>10.2f} {ours / peer:>6.2f} {r['peak_rss_mb']:>12.0f}")
    print("ratio = ours / peer throughput (peer: tokenizers on the same text, same chunk sizes)")


if __name__ == "__main__":
    main()
