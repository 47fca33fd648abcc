"""`plainformer serve` under load, against `transformers serve --continuous-batching` on the same directory.

The model is GPT-2 124M's shape (HF's GPT-2 initialisation, seed 0, copied into ours by `_hf_gpt2.gpt2_pair`)
with a byte-level BPE trained on the bundled corpus, exported to a Hugging Face directory that both servers
load. For 1, 4 and 16 concurrent clients (threads of the official `openai` client), each client streams
`--requests` completions of `--max-tokens` greedy tokens after the same `--prompt`-token prompt; measured:
aggregate completion tokens/s, time to first token and latency p50/p99. Our server runs this load without its
prefix cache (`--prefix-cache-mb 0`): every client sends the same prompt, which a cache would serve but the
last token of, so its TTFT would not be the prefill's. Each server runs alone (one at a time: 2 cores),
warmed up by one request first. `--quantize int8` serves our weight-only int8 model (the peer stays fp32).
Ratios are ours / peer tokens/s (higher is better) and ours / peer time (lower is better).

A second load has the clients share a system prompt (`--shared-prefix` tokens of the corpus, then a
`--prompt`-token part of each request's own): `--shared-clients` clients against our server with its prefix
cache (the default size) and without (`--prefix-cache-mb 0`), each warmed up by one request that carries the
prefix; measured: TTFT p50 and p99, and their ratio cached / uncached (target p50 <= 0.5x). `--tiny` swaps
GPT-2's shape for a 2-layer one and a 512-token BPE (with the same context), for a smoke run in seconds.

    python benchmarks/serve.py [--clients 1 4 16] [--requests 2] [--max-tokens 64] [--prompt 32] [--no-peer]
                               [--shared-prefix 512] [--shared-clients 16] [--quantize int8] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import torch

from _hf_gpt2 import gpt2_pair
from plainformer.data.tokenizers import BPETokenizer
from plainformer.hf.auto import save_hf
from plainformer.hf.tokenizer_files import load_hf_tokenizer

GPT2 = dict(n_layers=12, n_heads=12, d_model=768, d_ff=3072, block_size=1024)
TINY = dict(n_layers=2, n_heads=2, d_model=64, d_ff=128, block_size=1024)
CORPUS = Path(__file__).resolve().parents[1] / "src" / "plainformer" / "corpus" / "shakespeare.txt.gz"
START_TIMEOUT_S = 300


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=2, help="completions each client asks for, one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--vocab", type=int, default=50257, help="BPE vocabulary to train (the corpus may give less)")
    parser.add_argument("--no-peer", action="store_true", help="measure plainformer serve alone")
    parser.add_argument("--shared-prefix", type=int, default=512,
                        help="tokens of the system prompt each request of the shared load begins with (0: none)")
    parser.add_argument("--shared-clients", type=int, default=16, help="clients of the shared-prefix load")
    parser.add_argument("--quantize", choices=["int8"], default=None, help="serve our model quantized")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and a 512-token BPE: a smoke run")
    args = parser.parse_args(argv)
    if args.tiny:
        args.vocab = min(args.vocab, 512)
    return args


def gpt2_directory(directory: Path, vocab: int, tiny: bool) -> tuple[Path, str]:
    """GPT-2 124M's shape (or TINY's) with a BPE of the bundled corpus, as a Hugging Face directory; and the
    corpus's text."""
    import gzip

    text = gzip.decompress(CORPUS.read_bytes()).decode("utf-8")
    tokenizer = BPETokenizer.train(text[:200_000] if tiny else text, vocab, special_tokens=("eos",))
    ours, _ = gpt2_pair(vocab_size=tokenizer.vocab_size, **(TINY if tiny else GPT2))
    ours.tokenizer = tokenizer
    save_hf(ours, directory)
    return directory, text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(command: list[str], ready: str | None, port: int | None) -> tuple[subprocess.Popen, str]:
    """A server process, and its /v1 URL once it answers (from its log line, or by polling `port`)."""
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        log.seek(0)
        found = re.search(ready, log.read()) if ready else None
        url = found.group(1) if found else (f"http://127.0.0.1:{port}/v1" if port else None)
        if url and _answers(url):
            return process, url
        time.sleep(0.5)
    log.seek(0)
    process.kill()
    raise RuntimeError(f"{command[0]} did not start: {log.read()[-2000:]}")


def _answers(url: str) -> bool:
    try:
        openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=5).models.list()
        return True
    except (openai.APIError, OSError):
        return False


def stream_one(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, latency, completion tokens) of one streamed greedy completion."""
    start = time.perf_counter()
    first, tokens = None, 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    latency = time.perf_counter() - start
    return (latency if first is None else first), latency, tokens


def load(url: str, model: str, prompt: str | list[list[str]], clients: int, requests: int,
         max_tokens: int) -> dict[str, float]:
    """`clients` clients asking `requests` completions each, one after another: of `prompt`, or of
    prompt[client][request]."""
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)

    def one_client(c: int) -> list[tuple[float, float, int]]:
        return [stream_one(client, model, prompt if isinstance(prompt, str) else prompt[c][r], max_tokens)
                for r in range(requests)]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(one_client, range(clients)) for r in rs]
    wall = time.perf_counter() - start
    ttft = sorted(r[0] for r in results)
    latency = sorted(r[1] for r in results)
    return {"tokens_per_s": sum(r[2] for r in results) / wall, "ttft_p50": statistics.median(ttft),
            "ttft_p99": ttft[min(len(ttft) - 1, round(0.99 * len(ttft)))],
            "latency_p50": statistics.median(latency), "latency_p99": latency[min(len(latency) - 1,
                                                                                  round(0.99 * len(latency)))],
            "tokens": sum(r[2] for r in results), "wall_s": wall}


def measure(name: str, command: list[str], ready: str | None, port: int | None, model: str, prompt: str,
            args: argparse.Namespace) -> dict[int, dict[str, float]]:
    process, url = start(command, ready, port)
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        stream_one(client, model, prompt, 4)  # warm-up
        rows = {}
        for clients in args.clients:
            rows[clients] = load(url, model, prompt, clients, args.requests, args.max_tokens)
            print(f"{name:<12} {clients:>3} clients: {rows[clients]['tokens_per_s']:7.1f} tok/s, ttft p50 "
                  f"{rows[clients]['ttft_p50']:.3f} s, latency p50 {rows[clients]['latency_p50']:.2f} s p99 "
                  f"{rows[clients]['latency_p99']:.2f} s", file=sys.stderr)
        return rows
    finally:
        process.terminate()
        process.wait(60)


def measure_shared(command: list[str], model: str, prefix: str, parts: list[list[str]],
                   args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The shared-prefix load against our server with its default prefix cache and with none."""
    rows = {}
    for name, flags in (("cache", []), ("no cache", ["--prefix-cache-mb", "0"])):
        process, url = start(command + flags, r"at (http://\S+/v1)", None)
        try:
            client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
            stream_one(client, model, prefix + parts[-1][-1], 4)  # warm-up: the system prompt seen once
            prompts = [[prefix + part for part in client_parts] for client_parts in parts]
            rows[name] = load(url, model, prompts, args.shared_clients, args.requests, args.max_tokens)
            print(f"shared {args.shared_prefix}-token prefix, {name:<8} {args.shared_clients:>3} clients: "
                  f"{rows[name]['tokens_per_s']:7.1f} tok/s, ttft p50 {rows[name]['ttft_p50']:.3f} s p99 "
                  f"{rows[name]['ttft_p99']:.3f} s", file=sys.stderr)
        finally:
            process.terminate()
            process.wait(60)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env_threads = os.environ.get("OMP_NUM_THREADS")
    with tempfile.TemporaryDirectory() as tmp:
        directory, text = gpt2_directory(Path(tmp) / "gpt2-shape", args.vocab, args.tiny)
        own = load_hf_tokenizer(directory)
        ids = own.encode(text[:200_000])
        prompt = own.decode(ids[:args.prompt])  # the corpus's first --prompt tokens
        serve = [sys.executable, "-m", "plainformer", "serve", "--ckpt", str(directory), "--port", "0",
                 "--max-batch", "16", *(["--quantize", args.quantize] if args.quantize else [])]
        ours = measure("plainformer", [*serve, "--prefix-cache-mb", "0"], r"at (http://\S+/v1)", None, directory.name,
                       prompt, args)
        shared: dict[str, dict[str, float]] = {}
        if args.shared_prefix:
            # each request's own part: the next --prompt tokens of the corpus after the prefix, one slice each
            slices = (ids[args.shared_prefix + i * args.prompt:args.shared_prefix + (i + 1) * args.prompt]
                      for i in range(args.shared_clients * args.requests + 1))
            parts = [own.decode(part) for part in slices]
            per_client = [parts[c * args.requests:(c + 1) * args.requests] for c in range(args.shared_clients)]
            per_client[-1] = per_client[-1] + [parts[-1]]  # the warm-up's, asked by no client of the load
            shared = measure_shared(serve, directory.name, own.decode(ids[:args.shared_prefix]), per_client, args)
        peer: dict[int, dict[str, float]] = {}
        peer_note = "not run (--no-peer)"
        if not args.no_peer:
            port = free_port()
            try:
                peer = measure("transformers", [str(Path(sys.executable).with_name("transformers")), "serve",
                                                str(directory), "--continuous-batching", "--port", str(port),
                                                "--host", "127.0.0.1"],
                               None, port, str(directory), prompt, args)
                peer_note = "transformers serve --continuous-batching"
            except (RuntimeError, openai.APIError) as error:
                peer_note = f"transformers serve did not run: {str(error).splitlines()[-1][:300]}"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (OMP_NUM_THREADS={env_threads}), AMX: "
          f"{torch.cpu._is_amx_tile_supported()}, capability {torch.backends.cpu.get_cpu_capability()}; "
          f"{'a 2-layer (--tiny)' if args.tiny else 'GPT-2 124M'} shape{', ours int8' if args.quantize else ''}, "
          f"vocab {own.vocab_size}, prompt {args.prompt} "
          f"tokens, {args.max_tokens} greedy tokens, "
          f"{args.requests} requests per client; peer: {peer_note}")
    print(f"{'clients':>7} {'ours tok/s':>10} {'peer tok/s':>10} {'ratio':>6} {'ttft p50 ours/peer s':>21} "
          f"{'latency p50 ours/peer s':>24} {'p99 ours/peer s':>16}")
    for clients, row in ours.items():
        other = peer.get(clients)
        ratio = f"{row['tokens_per_s'] / other['tokens_per_s']:5.2f}x" if other else "     -"
        print(f"{clients:>7} {row['tokens_per_s']:>10.1f} {other['tokens_per_s'] if other else float('nan'):>10.1f} "
              f"{ratio} {row['ttft_p50']:>10.3f}/{other['ttft_p50'] if other else float('nan'):<10.3f} "
              f"{row['latency_p50']:>12.2f}/{other['latency_p50'] if other else float('nan'):<11.2f} "
              f"{row['latency_p99']:>7.2f}/{other['latency_p99'] if other else float('nan'):<8.2f}")
    first, last = min(ours), max(ours)
    scaling = ours[last]["tokens_per_s"] / ours[first]["tokens_per_s"]
    ttft_growth = ours[last]["ttft_p50"] / ours[first]["ttft_p50"]
    print(f"ours at {last} clients: {scaling:.2f}x the tokens/s of {first} (target >= 4x); ttft p50 {ttft_growth:.2f}x "
          f"(target <= 3x)" + (f"; {ours[last]['tokens_per_s'] / peer[last]['tokens_per_s']:.2f}x the peer's tokens/s "
                                "(target >= 2x)" if last in peer else ""))
    shared_ratio = None
    if shared:
        shared_ratio = shared["cache"]["ttft_p50"] / shared["no cache"]["ttft_p50"]
        print(f"shared {args.shared_prefix}-token prefix at {args.shared_clients} clients: ttft p50 "
              f"{shared['cache']['ttft_p50']:.3f} s with the prefix cache, {shared['no cache']['ttft_p50']:.3f} s "
              f"without: {shared_ratio:.2f}x (target <= 0.5x); p99 {shared['cache']['ttft_p99']:.3f} / "
              f"{shared['no cache']['ttft_p99']:.3f} s")
    print(json.dumps({"benchmark": "serve", "ours": ours, "peer": peer, "peer_note": peer_note,
                      "scaling": scaling, "ttft_growth": ttft_growth, "shared": shared,
                      "shared_ttft_ratio": shared_ratio}))


if __name__ == "__main__":
    main()
