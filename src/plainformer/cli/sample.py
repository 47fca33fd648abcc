"""`plainformer sample`: text from a trained GPT (a checkpoint, a run, or a Hugging Face GPT-2 / Llama
directory) on stdout, and only that text.

One sample streams as it is drawn. `--num-samples N` and `--prompt-file FILE` (one prompt a line) draw
every sample in one batch, prompts of different lengths left-padded, each row as it would be alone:
sample i of the batch uses seed `--seed` + i, so its text is that of `--seed SEED+i` alone. The samples
print in order, each with its prompt, separated by a `--separator` line. `--stop STRING` (repeatable)
ends a sample where it first writes STRING, which is not printed.

On the CPU the weights are laid out once for oneDNN before decoding (`inference.for_decoding`: a fraction of a
second, for more tokens/s than the plain layout's; measured: docs/performance.md, "Choices inside the code"),
where this CPU's oneDNN takes their dtype.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..families.family import checkpoint_dir
from ..families.gpt import load_language_model
from ..families.memory_estimates import check_decoding_memory
from ..generation.decoding import generate_prompts, iter_generate
from ..generation.sampling import derived_seed
from ..generation.stopping import StopStrings
from ..inference import for_decoding
from ..models.gpt import GPT
from ..nn.lora import unload_lora
from . import (
    QUANTIZE_HELP,
    UserError,
    add_dtype_argument,
    add_max_memory_argument,
    add_product_arguments,
    mass,
    non_negative_int,
    non_negative_number,
    positive_int,
    seed_int,
    utf8_text,
)


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser("sample", help="sample text from a trained GPT",
                                    description="Sampled text on stdout, and only that text; the same seed "
                                                "gives the same text. Metrics go to stderr (or end stdout "
                                                "with --json).")
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="checkpoint directory, or a run directory (its best/ or last/)")
    add_dtype_argument(parser)
    parser.add_argument("--quantize", choices=("int8",), help=QUANTIZE_HELP)
    parser.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    parser.add_argument("--prompt-file", type=Path, metavar="FILE",
                        help="one prompt a line (an escaped \\n is a newline), sampled in one batch")
    parser.add_argument("--num-samples", type=positive_int, default=1, metavar="N",
                        help="samples of each prompt, in one batch (default: 1)")
    parser.add_argument("--stop", action="append", default=[], metavar="STRING", type=_stop_string,
                        help="end a sample where it writes STRING (not printed); repeatable")
    parser.add_argument("--separator", default="---", metavar="LINE",
                        help="the line between samples (default: ---)")
    parser.add_argument("--max-new-tokens", type=non_negative_int, default=500, metavar="N",
                        help="tokens to draw after the prompt, at most (default: %(default)s)")
    parser.add_argument("--temperature", type=non_negative_number, default=0.8, help="0 = greedy (default: 0.8)")
    parser.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                        help="draw from the K most likely tokens only (default: all)")
    parser.add_argument("--top-p", type=mass, default=None, metavar="P",
                        help="nucleus: draw from the fewest most likely tokens whose probability reaches P "
                             "(default: 1, all)")
    parser.add_argument("--seed", type=seed_int, default=1337, help="of the first sample; sample i uses SEED+i")
    parser.add_argument("--no-cache", action="store_true", help="recompute the context at each step")
    add_max_memory_argument(parser)
    add_product_arguments(parser)
    parser.set_defaults(run=run_sample)


def _stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty string")
    return text


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt_file is None:
        return ["\n" if args.prompt is None else args.prompt]
    if args.prompt is not None:
        raise UserError("give --prompt or --prompt-file, not both")
    if not args.prompt_file.is_file():
        raise UserError(f"--prompt-file {args.prompt_file} is not a file")
    lines = utf8_text(args.prompt_file.read_bytes(), str(args.prompt_file)).splitlines()
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise UserError(f"--prompt-file {args.prompt_file} holds no prompt (one a line)")
    return prompts


def _encoded(tokenizer: Any, prompts: list[str], flag: str) -> list[list[int]]:
    encoded = [tokenizer.encode(prompt) for prompt in prompts]
    for line, ids in enumerate(encoded, start=1):
        if not ids:
            where = f" (line {line})" if flag == "--prompt-file" else ""
            raise UserError(f"{flag}{where} encodes to no tokens; give at least one character")
    return encoded


def run_sample(args: argparse.Namespace) -> dict[str, Any]:
    prompts = _prompts(args)
    flag = "--prompt" if args.prompt_file is None else "--prompt-file"
    model, tokenizer = load_language_model(checkpoint_dir(args.ckpt), args.dtype, quantized=args.quantize)
    unload_lora(model)  # a LoRA run's adapter merged: decoding then costs what the base's does
    encoded = _encoded(tokenizer, prompts, flag)
    rows = len(encoded) * args.num_samples
    check_decoding_memory(model, rows, max(map(len, encoded)), f"sampling {rows} row(s) at once (--num-samples times "
                          "the prompts)")
    for_decoding(model)
    stop = StopStrings(tokenizer.decode, args.stop) if args.stop else None
    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, use_cache=not args.no_cache)
    start = time.perf_counter()
    with torch.inference_mode():
        if len(encoded) == 1 and args.num_samples == 1:
            new_tokens = _stream(model, prompts[0], encoded[0], args, stop, options)
            samples = 1
        else:
            new_tokens, samples = _batch(model, prompts, encoded, args, stop, options)
    elapsed = time.perf_counter() - start
    return {"samples": samples, "new_tokens": new_tokens, "tokens_per_s": new_tokens / max(elapsed, 1e-9),
            "elapsed_s": elapsed, "seed": args.seed}


def _stream(model: GPT, prompt: str, ids: list[int], args: argparse.Namespace, stop: StopStrings | None,
            options: dict[str, Any]) -> int:
    """Print one sample as it is drawn, holding back what could begin a stop string; -> new tokens."""
    tokenizer = model.tokenizer
    assert tokenizer is not None  # load_language_model refuses a model without one
    generator = torch.Generator().manual_seed(args.seed)
    sys.stdout.write(prompt)
    new_ids: list[int] = []
    printed = ""
    for tokens, _ in iter_generate(model.decoder(), torch.tensor([ids]), args.max_new_tokens,
                                   generator=generator, **options):
        new_ids.append(int(tokens[0]))
        text = tokenizer.decode(new_ids)  # whole suffix: a BPE token may end mid-character
        cut = None if stop is None else stop.cut(text)
        shown = text[:cut] if cut is not None else text[:len(text) - (stop.held_back(text) if stop else 0)]
        sys.stdout.write(shown[len(printed):])
        sys.stdout.flush()
        printed = shown
        if cut is not None:
            break
    sys.stdout.write("\n")
    return len(new_ids)


def _batch(model: GPT, prompts: list[str], encoded: list[list[int]], args: argparse.Namespace,
           stop: StopStrings | None, options: dict[str, Any]) -> tuple[int, int]:
    """Every sample of every prompt in one batch, printed in order; -> (new tokens, samples)."""
    tokenizer = model.tokenizer
    assert tokenizer is not None  # load_language_model refuses a model without one
    rows = [(prompt, ids) for prompt, ids in zip(prompts, encoded, strict=True) for _ in range(args.num_samples)]
    generators = [torch.Generator().manual_seed(derived_seed(args.seed, row)) for row in range(len(rows))]
    outputs = generate_prompts(model.decoder(), [ids for _, ids in rows], args.max_new_tokens, stop=stop,
                               generator=generators, device=model.token_embedding.weight.device, **options)
    new_tokens = 0
    for row, ((prompt, ids), output) in enumerate(zip(rows, outputs, strict=True)):
        text = tokenizer.decode(output[len(ids):])
        cut = None if stop is None else stop.cut(text)
        if row:
            sys.stdout.write(args.separator + "\n")
        sys.stdout.write(prompt + text[:cut] + "\n")
        new_tokens += len(output) - len(ids)
    sys.stdout.flush()
    return new_tokens, len(rows)
