"""`plainformer serve`: the model of a run, a LoRA run or a Hugging Face GPT-2 / Llama / Mixtral directory
behind an OpenAI-compatible HTTP API (`plainformer.serve`), every request decoded in one continuously
batched run.

It binds the address itself before serving, so a port in use is one line, and `--port 0` takes a free
port; the line it logs names the URL it listens on and the model. Ctrl-C or SIGTERM stops it: no new
connection is taken, what is in flight gets a few seconds to finish and is then cancelled, and it
exits 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import time
from pathlib import Path
from typing import Any

from ..families.family import checkpoint_dir
from ..families.gpt import check_decoding_memory, load_language_model
from ..inference import for_decoding
from ..launch import log
from ..nn.lora import unload_lora
from . import QUANTIZE_HELP, UserError, add_dtype_argument, add_max_memory_argument, positive_int

GRACE_S = 3  # how long requests in flight may take to finish once a stop is asked for


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "serve", help="serve a GPT over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /health) "
                    "over one model, with continuous batching. Needs the serve extra: "
                    "pip install 'plainformer[serve]'.")
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="checkpoint directory, run directory, or Hugging Face GPT-2/Llama/Mixtral directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=_port, default=8000, help="port (default: %(default)s; 0: a free one)")
    parser.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every /v1 request")
    parser.add_argument("--max-batch", type=positive_int, default=16, metavar="N",
                        help="rows decoded at once, all requests together (default: %(default)s)")
    parser.add_argument("--max-queue", type=positive_int, default=64, metavar="N",
                        help="requests that may wait for room; more are answered 429 (default: %(default)s)")
    parser.add_argument("--model-name", metavar="NAME",
                        help="the model's id in the API (default: the directory's name)")
    add_dtype_argument(parser)
    parser.add_argument("--quantize", choices=("int8",), help=QUANTIZE_HELP)
    add_max_memory_argument(parser)
    parser.set_defaults(run=run_serve, product=True, json=False)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {text!r}")
    return int(text)


def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from ..serve import server
        from ..serve.app import create_app
        from ..serve.service import Service
    except ImportError as error:
        raise UserError(f"plainformer serve needs the serve extra ({error.name} is missing): "
                        "pip install 'plainformer[serve]'") from None
    try:
        sock = server.listen(args.host, args.port)
    except OSError as error:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}") from None
    path = checkpoint_dir(args.ckpt)
    model, _ = load_language_model(path, args.dtype, quantized=args.quantize)
    unload_lora(model)  # a LoRA run's adapter merged: decoding then costs what the base's does
    check_decoding_memory(model, args.max_batch, model.config.block_size, f"serving --max-batch {args.max_batch} rows")
    for_decoding(model)
    name = args.model_name or _default_name(args.ckpt)
    service = Service(model.eval(), name, max_batch=args.max_batch, max_queue=args.max_queue)
    host, port = sock.getsockname()[:2]
    if not args.api_key and not ipaddress.ip_address(host).is_loopback:
        log(f"plainformer serve: warning: listening on {host}, beyond this machine, with no --api-key: "
            "anyone who reaches it can use the model")
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
    ready = f"plainformer serve: {name} at {url} (--max-batch {args.max_batch}); Ctrl-C to stop"
    start = time.perf_counter()
    server.run(create_app(service, api_key=args.api_key, on_ready=lambda: log(ready)), sock, service.batcher,
               grace_s=GRACE_S)
    return {"model": name, "served_s": time.perf_counter() - start, "decoding_steps": service.batcher.steps}


def _default_name(ckpt: Path) -> str:
    """The model's id: the run's directory name (not best/ or last/ within it)."""
    path = ckpt.resolve()
    return path.parent.name if path.name in ("best", "last") else path.name
