"""Greedy decoding speed at the GPT-2 (124M) shape against Hugging Face `generate` (issue 3).

    python benchmarks/generate.py [--new-tokens 256] [--prompt 32] [--repeats 3] [--uncached-repeats 1]

Batch 1, a random 32-token prompt, 256 new tokens, temperature 0 (argmax), random weights (HF's GPT-2
initialisation, copied into ours by `_hf_gpt2.gpt2_pair`, so both models compute the same function
and must produce the same tokens in fp32: the last column counts the leading tokens equal to the
peer's; in bf16 rounding differs between implementations, so they part sooner or later). Rows:
  ours (KV cache)     `GPT.generate(..., temperature=0)`: preallocated KV cache, one token per step
  ours (no cache)     `use_cache=False`: the whole context again at every step
  ours bf16           the same model cast to bfloat16 (weights, cache and activations)
  ours prepacked      `pf.prepack(model)`: every linear layer's weight reordered once for oneDNN (what
                      `plainformer sample` decodes with on the CPU); fp32, and bf16 where oneDNN packs it
  ours int8           `pf.quantize(model, "int8")`: weight-only int8, per output row, on the fastest kernel
                      measured on this CPU (nn/quantize.py; target: >= 1.6x our fp32 where one is fast)
  HF                  `GPT2LMHeadModel.generate(do_sample=False)` (its dynamic KV cache), fp32 and bf16
  ours batch 8 mixed  `GPT.generate([8 prompts], ...)`: 8 prompts of lengths prompt/8 .. prompt in one
                      left-padded batch, against the same 8 decoded one after another ("8 single runs");
                      tokens/s counts every row's new tokens (target: the batch >= 4x the single runs)
Timing: each decoder is warmed up on a short run, then `--repeats` rounds time every decoder once
(interleaved, so a busy machine slows them all alike); the uncached path is slow and runs only in
the first `--uncached-repeats` rounds. Medians are quoted. ratio = ours / peer in tokens/s (higher is
better); the last row compares our cached decoding with our uncached one.

Memory: the extra peak bytes of torch's CPU allocator while decoding MEMORY_TOKENS = 16 tokens beyond
the weights (caches, logits, our decoder's transposed fp32 output weight; `attention.extra_peak_bytes`),
untimed.

Bound: decoding one token reads every weight once, so tokens/s <= memory bandwidth / weight bytes; the
script measures the bandwidth (copying a 512 MB buffer) and prints that bound for fp32 and bf16. What
torch's kernels allow is printed beside it: the read-only bandwidth (summing the buffer) and the
matrix-vector ceiling, one pass of F.linear over every weight matrix in the decoder's layout and nothing
else (`matvec_seconds`).
Output: a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

import plainformer as pf
from plainformer.inference.linear_kernels import measure_kernels
from plainformer.inference.prepack import prepack_supported

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _hf_gpt2 import gpt2_pair
from attention import extra_peak_bytes

MEMORY_TOKENS = 16

# (what, ours, peer) rows of the table, by decoder name
COMPARISONS = [
    ("fp32: ours (KV cache) vs HF", "ours (KV cache)", "HF"),
    ("bf16: ours (KV cache) vs HF bf16", "ours bf16 (KV cache)", "HF bf16"),
    ("ours bf16 vs HF fp32", "ours bf16 (KV cache)", "HF"),
    ("fp32: ours prepacked vs HF", "ours prepacked (KV cache)", "HF"),
    ("bf16: ours prepacked vs HF bf16", "ours bf16 prepacked (KV cache)", "HF bf16"),
    ("fp32: ours KV cache vs no cache", "ours (KV cache)", "ours (no cache)"),
    ("fp32: batch 8 mixed vs 8 single runs", "ours batch 8 mixed", "ours 8 single runs"),
    ("int8: ours vs ours fp32", "ours int8 (KV cache)", "ours (KV cache)"),
    ("int8: ours vs HF fp32", "ours int8 (KV cache)", "HF"),
]
BATCH = 8
GPT2 = dict(n_layers=12, n_heads=12, d_model=768, d_ff=3072, vocab_size=50257, block_size=1024)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=32, help="prompt length")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of the cached decoders")
    parser.add_argument("--uncached-repeats", type=int, default=1, help="rounds that also time use_cache=False")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if min(args.new_tokens, args.prompt, args.repeats) < 1 or args.uncached_repeats < 0:
        parser.error("--new-tokens, --prompt and --repeats must be positive")
    return args


def memory_bandwidth(megabytes: int = 512, rounds: int = 5) -> float:
    """Best bytes/s of copying a buffer (read + write) too large for the caches."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * 4 / best


def decoders(prompt: torch.Tensor) -> tuple[dict[str, Callable[[int], torch.Tensor]], pf.GPT]:
    """(name -> function(n) decoding n new tokens greedily from `prompt`, returning them (1, n);
    our fp32 model)."""
    ours, theirs = gpt2_pair(**GPT2)
    ours.eval(), theirs.eval()
    theirs.generation_config.eos_token_id = None  # never stop early: exactly n tokens
    theirs.generation_config.pad_token_id = 0
    ours_bf16 = copy.deepcopy(ours).to(torch.bfloat16)
    ours_int8 = pf.quantize(copy.deepcopy(ours), "int8")
    prepacked = {name: pf.prepack(copy.deepcopy(model)) for name, model in
                 (("ours prepacked (KV cache)", ours), ("ours bf16 prepacked (KV cache)", ours_bf16))
                 if prepack_supported(model.lm_head.weight.dtype)}
    for model in (ours, ours_bf16):  # as `plainformer translate` decodes, and `sample` where prepacking is not had
        measure_kernels(model)
    theirs_bf16 = copy.deepcopy(theirs).to(torch.bfloat16)
    mask = torch.ones_like(prompt)

    def ours_call(model, use_cache=True):
        return lambda n: model.generate(prompt, n, temperature=0, use_cache=use_cache)[:, prompt.shape[1]:]

    def hf_call(model):
        return lambda n: model.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                        do_sample=False)[:, prompt.shape[1]:]

    lengths = [max(1, prompt.shape[1] * (i + 1) // BATCH) for i in range(BATCH)]
    prompts = [torch.randint(GPT2["vocab_size"], (n,), generator=torch.Generator().manual_seed(i)).tolist()
               for i, n in enumerate(lengths)]

    def batch_call(n):  # (8, n): each row's new tokens
        outputs = ours.generate(prompts, n, temperature=0)
        return torch.tensor([row[len(p):] for row, p in zip(outputs, prompts, strict=True)])

    def singles_call(n):
        return torch.cat([ours.generate(torch.tensor([p]), n, temperature=0)[:, len(p):] for p in prompts])

    return {"ours (KV cache)": ours_call(ours), "HF": hf_call(theirs),
            "ours bf16 (KV cache)": ours_call(ours_bf16), "HF bf16": hf_call(theirs_bf16),
            "ours (no cache)": ours_call(ours, use_cache=False), "ours int8 (KV cache)": ours_call(ours_int8),
            **{name: ours_call(model) for name, model in prepacked.items()},
            "ours batch 8 mixed": batch_call,
            "ours 8 single runs": singles_call}, ours


def read_bandwidth(megabytes: int = 512, rounds: int = 5) -> float:
    """Best bytes/s of reading a buffer too large for the caches (a sum: no write)."""
    source = torch.ones(megabytes * 2**20 // 4)
    return source.numel() * 4 / min(_seconds(source.sum) for _ in range(rounds))


def matvec_seconds(model: pf.GPT, rounds: int = 5) -> float:
    """Best seconds of one pass of torch's matrix-vector products over every weight matrix of `model`
    in its decoder's layout (nn.Linear's (out, in); the tied output weight as Eᵀ, `GPTDecoder`'s copy),
    with nothing else: the fastest a batch-1 fp32 step could be on these kernels."""
    head_t = model.lm_head.weight.detach().t().contiguous()
    weights = [m.weight.detach() for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    row = torch.randn(1, head_t.shape[0])

    def one_pass() -> None:
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)
        row @ head_t

    one_pass()
    return min(_seconds(one_pass) for _ in range(rounds))


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def agreeing_prefix(tokens: torch.Tensor, reference: torch.Tensor) -> int:
    """How many leading tokens of (B, n) `tokens`, row after row, equal `reference`'s."""
    differ = (tokens != reference).flatten().nonzero()
    return int(differ[0]) if len(differ) else tokens.numel()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = memory_bandwidth()
    prompt = torch.randint(GPT2["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(0))
    calls, model = decoders(prompt)
    weight_bytes = {"fp32": model.num_parameters() * 4, "bf16": model.num_parameters() * 2}
    bound = bandwidth / weight_bytes["fp32"]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} "
          f"threads; measured memory bandwidth {bandwidth / 1e9:.1f} GB/s -> bound "
          f"{bound:.0f} tok/s fp32, {bandwidth / weight_bytes['bf16']:.0f} tok/s bf16")
    reading, ceiling = read_bandwidth(), 1 / matvec_seconds(model)
    print(f"read-only bandwidth {reading / 1e9:.1f} GB/s ({reading / bandwidth:.0%} of the copy's); torch's "
          f"matrix-vector kernels over every weight once: {ceiling:.1f} tok/s ({ceiling / bound:.0%} of the "
          "fp32 bound), the fastest a batch-1 fp32 step can be on them")
    for call in calls.values():
        call(4)
    times: dict[str, list[float]] = {name: [] for name in calls}
    tokens: dict[str, torch.Tensor] = {}
    for round_ in range(args.repeats):
        for name, call in calls.items():
            if name == "ours (no cache)" and round_ >= args.uncached_repeats:
                continue
            start = time.perf_counter()
            tokens[name] = call(args.new_tokens)
            times[name].append(time.perf_counter() - start)
    speed = {name: tokens[name].numel() / statistics.median(ts) for name, ts in times.items() if ts}
    peak_mib = {name: extra_peak_bytes(lambda call=call: call(MEMORY_TOKENS)) / 2**20
                for name, call in calls.items() if name in speed}
    rows = []
    print(f"{'what':<34} {'ours tok/s':>10} {'peer tok/s':>10} {'ratio':>6} {'peak MiB ours/peer':>19}  "
          f"tokens as peer's")
    for what, ours, peer in COMPARISONS:
        if ours not in speed or peer not in speed:
            continue
        row = {"what": what, "ours": ours, "peer": peer, "ours_tokens_per_s": speed[ours],
               "peer_tokens_per_s": speed[peer], "ratio": speed[ours] / speed[peer],
               "ours_peak_mib": peak_mib[ours], "peer_peak_mib": peak_mib[peer],
               "tokens_as_peer": agreeing_prefix(tokens[ours], tokens[peer])}
        rows.append(row)
        print(f"{what:<34} {speed[ours]:>10.1f} {speed[peer]:>10.1f} {row['ratio']:>5.2f}x "
              f"{peak_mib[ours]:>9.0f}/{peak_mib[peer]:<9.0f}  {row['tokens_as_peer']}/{tokens[ours].numel()}")
    print("ratio = ours / peer tokens/s (higher is better)")
    print(json.dumps({"benchmark": "generate", "threads": torch.get_num_threads(), "new_tokens": args.new_tokens,
                      "prompt": args.prompt, "memory_bandwidth": bandwidth, "read_bandwidth": reading,
                      "matvec_ceiling_tokens_per_s": ceiling, "repeats": args.repeats,
                      "rows": rows}))


if __name__ == "__main__":
    main()
