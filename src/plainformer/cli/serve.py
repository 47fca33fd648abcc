"""`plainformer serve`: the model of a run, a LoRA run or a Hugging Face GPT-2 / Llama / Mixtral directory
behind an OpenAI-compatible HTTP API (`plainformer.serve`), every request decoded in one continuously
batched run; or a BERT (MiniLM, a Hugging Face BERT directory, a BERT run) that answers /v1/embeddings as
`plainformer embed` computes them. A GPT embeds too when given --pooling.

It binds the address itself before serving, so a port in use is one line, and `--port 0` takes a free
port; the line it logs names the URL it listens on and the model. A key that no request could send
(empty, or not printable ASCII), a chat template with a syntax error, or more connections than the
open-file limit allows are one line at start. Ctrl-C or SIGTERM stops it: no new connection is taken,
what is in flight gets --timeout-shutdown seconds to finish and is then ended with an error (a second
signal ends the wait), and it exits 0.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import time
from pathlib import Path
from typing import Any

import torch

from ..families.family import checkpoint_dir
from ..families.finetuning import base_family
from ..families.gpt import load_language_model
from ..families.memory_estimates import check_decoding_memory
from ..generation.prefix_cache import default_capacity
from ..hf.bert import MINILM_NAME
from ..inference import for_decoding
from ..log import log
from ..memory import MemoryBudgetError, available_phrase, device_available, format_size
from ..nn.lora import unload_lora
from ..serve.chat import TIMEOUT_S as TEMPLATE_TIMEOUT_S
from ..serve.embeddings import POOLINGS, PooledGPT, SentenceEmbedder
from ..serve.limits import FILES_RESERVED, Connections, raise_file_limit
from ..serve.service import MAX_RESPONSE_TOKENS, Service
from . import (
    QUANTIZE_HELP,
    UserError,
    add_dtype_argument,
    add_max_memory_argument,
    non_negative_number,
    positive_int,
    positive_number,
)
from .embed import DTYPES, load_encoder

GRACE_S = 3  # how long requests in flight may take to finish once a stop is asked for


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "serve", help="serve a GPT over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models, "
                    "/tokenize, /detokenize, /health, /metrics) over one model, with continuous batching. A BERT "
                    "(minilm, or a BERT directory or run) answers /v1/embeddings only. Needs the serve extra: "
                    "pip install 'plainformer[serve]'.")
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="checkpoint directory, run directory, or Hugging Face GPT-2/Llama/Mixtral directory; "
                             f"or {MINILM_NAME}, a Hugging Face BERT directory or a BERT run, to serve embeddings")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=_port, default=8000, help="port (default: %(default)s; 0: a free one)")
    parser.add_argument("--api-key", metavar="KEY", type=_api_key,
                        help="require 'Authorization: Bearer KEY' on every /v1 request (printable ASCII)")
    parser.add_argument("--max-batch", type=positive_int, default=16, metavar="N",
                        help="rows decoded at once, all requests together (default: %(default)s)")
    parser.add_argument("--max-queue", type=positive_int, default=64, metavar="N",
                        help="prompts that may wait for room, each prompt of a request one; more are answered "
                             "429, and a request with more prompts than this 400 (default: %(default)s)")
    parser.add_argument("--max-response-tokens", type=positive_int, default=MAX_RESPONSE_TOKENS, metavar="N",
                        help="tokens one response may carry, counting echoed prompts and each logprob alternative; "
                             "a request that could exceed it is answered 400 (default: %(default)s)")
    parser.add_argument("--prefix-cache-mb", type=non_negative_number, metavar="MB",
                        help="megabytes (10^6 bytes) of prompts' keys and values kept for the prompts that begin as "
                             "they do, least recently used evicted first, at most the memory available once the "
                             "model is loaded (--max-memory's when given); 0: none (default: an eighth of that "
                             "memory, at most 4 GiB; a model with a sliding window keeps none)")
    parser.add_argument("--model-name", metavar="NAME",
                        help="the model's id in the API (default: the directory's name)")
    parser.add_argument("--pooling", choices=POOLINGS,
                        help="let a GPT answer /v1/embeddings: the mean or the last of its final hidden states, "
                             "L2-normalised (default: a GPT does not embed)")
    add_dtype_argument(parser)
    parser.add_argument("--quantize", choices=("int8",), help=QUANTIZE_HELP)
    add_max_memory_argument(parser)
    limits = parser.add_argument_group("connections and time limits (seconds)")
    defaults = Connections()
    limits.add_argument("--max-connections", type=positive_int, default=defaults.max_connections, metavar="N",
                        help="connections held at once; one more is answered 503 and closed (default: %(default)s)")
    limits.add_argument("--timeout-headers", type=positive_number, default=defaults.header_timeout, metavar="S",
                        help="a request's headers must arrive within S of its first byte (default: %(default)s)")
    limits.add_argument("--timeout-body", type=positive_number, default=defaults.body_timeout, metavar="S",
                        help="a request's body must arrive within S of its headers (default: %(default)s)")
    limits.add_argument("--timeout-keep-alive", type=positive_number, default=defaults.keep_alive, metavar="S",
                        help="an idle connection is closed after S (default: %(default)s)")
    limits.add_argument("--timeout-shutdown", type=non_negative_number, default=GRACE_S, metavar="S",
                        help="after Ctrl-C or SIGTERM, requests in flight may finish for S before they are ended "
                             "with an error (default: %(default)s)")
    limits.add_argument("--timeout-template", type=positive_number, default=TEMPLATE_TIMEOUT_S, metavar="S",
                        help="a chat template from the model directory must render within S, else the request is "
                             "refused (default: %(default)s)")
    parser.set_defaults(run=run_serve, product=True, json=False)


def _api_key(text: str) -> str:
    """A key a client can send in a header: printable ASCII, without spaces, not empty."""
    if not text or not text.isascii() or not text.isprintable() or " " in text:
        raise argparse.ArgumentTypeError("expected printable ASCII without spaces, which an HTTP header can carry")
    return text


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {text!r}")
    return int(text)


def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from ..serve import server
        from ..serve.app import create_app
        from ..serve.chat import TemplateRenderer
    except ImportError as error:
        raise UserError(f"plainformer serve needs the serve extra ({error.name} is missing): "
                        "pip install 'plainformer[serve]'") from None
    connections = Connections(args.max_connections, args.timeout_headers, args.timeout_body, args.timeout_keep_alive)
    files = raise_file_limit()
    if args.max_connections > files - FILES_RESERVED:
        raise UserError(f"--max-connections {args.max_connections} needs more open files than this process may have "
                        f"({files}, `ulimit -n`, {FILES_RESERVED} of them kept for the rest): at most "
                        f"{max(files - FILES_RESERVED, 0)}")
    try:
        sock = server.listen(args.host, args.port)
    except OSError as error:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}") from None
    name = args.model_name or _default_name(args.ckpt)
    service = _service(args, name)
    renderer = TemplateRenderer(service.tokenizer, name, timeout_s=args.timeout_template)
    try:
        renderer.start()
    except ValueError as error:
        renderer.close()
        raise UserError(f"the chat template of {args.ckpt} {error}") from None
    # what is loaded by now (torch's objects, the model's: 330,000 for a small model) lives until exit: frozen,
    # no garbage collection walks it again, so that parsing a body of half a million prompts holds the
    # interpreter 0.2 s, not 1.4 s
    gc.freeze()
    host, port = sock.getsockname()[:2]
    if not args.api_key and not ipaddress.ip_address(host).is_loopback:
        log(f"plainformer serve: warning: listening on {host}, beyond this machine, with no --api-key: "
            "anyone who reaches it can use the model")
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
    batcher = service.batcher
    if batcher is None:
        serving = "embeddings"
    else:
        cache = batcher.prefix_cache
        cached = f"a prefix cache of {format_size(cache.capacity)}" if cache is not None else "no prefix cache"
        serving = f"--max-batch {args.max_batch}, {cached}"
    ready = f"plainformer serve: {name} at {url} ({serving}); Ctrl-C to stop"
    start = time.perf_counter()
    app = create_app(service, api_key=args.api_key, renderer=renderer, on_ready=lambda: log(ready))
    server.run(app, sock, batcher or server.Idle(), grace_s=args.timeout_shutdown, connections=connections)
    return {"model": name, "served_s": time.perf_counter() - start,
            "decoding_steps": 0 if batcher is None else batcher.steps,
            "prefix_cache_hits": 0 if batcher is None else batcher.prefix_cache_hits}


def _service(args: argparse.Namespace, name: str) -> Service:
    """The Service of --ckpt: a GPT (embedding too with --pooling), or a BERT that only embeds."""
    if str(args.ckpt) == MINILM_NAME:
        family = "bert"
    else:
        path = checkpoint_dir(args.ckpt)
        family = base_family(str(path))
    if family == "bert":
        for flag, value in (("--pooling", args.pooling), ("--quantize", args.quantize)):
            if value is not None:
                raise UserError(f"{flag} is for a GPT; {args.ckpt} holds a BERT, which embeds as plainformer embed "
                                "does (mean pooling)")
        encoder = load_encoder(str(args.ckpt))
        return Service(None, name, embedder=SentenceEmbedder(encoder, dtype=DTYPES[args.dtype]),
                       max_response_tokens=args.max_response_tokens)
    model, _ = load_language_model(path, args.dtype, quantized=args.quantize)
    unload_lora(model)  # a LoRA run's adapter merged: decoding then costs what the base's does
    check_decoding_memory(model, args.max_batch, model.config.block_size, f"serving --max-batch {args.max_batch} rows")
    for_decoding(model)
    model.eval()
    embedder = None if args.pooling is None else PooledGPT(model, args.pooling)
    device = model.token_embedding.weight.device
    cache_bytes = default_capacity(device) if args.prefix_cache_mb is None else _prefix_cache_bytes(args, device)
    return Service(model, name, embedder=embedder, max_batch=args.max_batch, max_queue=args.max_queue,
                   max_response_tokens=args.max_response_tokens, prefix_cache_bytes=cache_bytes)


def _prefix_cache_bytes(args: argparse.Namespace, device: torch.device) -> int:
    """--prefix-cache-mb in bytes: at most the memory free once the model is loaded (within --max-memory)."""
    free = device_available(device)
    if args.prefix_cache_mb * 1e6 > free:
        where = available_phrase() if device.type == "cpu" else f"the {format_size(free)} free on {device}"
        raise MemoryBudgetError(f"--prefix-cache-mb {args.prefix_cache_mb:g} is more than {where} once the model "
                                f"is loaded: at most {free // 10**6}")
    return int(args.prefix_cache_mb * 1e6)


def _default_name(ckpt: Path) -> str:
    """The model's id: the run's directory name (not best/ or last/ within it)."""
    path = ckpt.resolve()
    return path.parent.name if path.name in ("best", "last") else path.name
