"""A model trained here, and `plainformer serve` over it as a real process on a free loopback port; a
model that decodes slowly, to hold a batch row for seconds; and raw HTTP over a socket."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import pytest
import torch

import plainformer as pf
from plainformer.data.tokenizers import CharTokenizer
from tests.reference.runs import trained_run

API_KEY = "test-key"
TINY = ["--n-layers", "2", "--n-heads", "2", "--d-model", "32", "--d-ff", "64", "--block-size", "128",
        "--batch-size", "4", "--eval-interval", "20", "--eval-batches", "2", "--warmup-steps", "2"]


@pytest.fixture(scope="package")
def run(tmp_path_factory) -> Path:
    text = "\n\n".join(f"USER:\nTo be, or not to be, that is the question {i}.\n\nASSISTANT:\n"
                       f"Whether 'tis nobler in the mind to suffer {i}.\n" * 8 for i in range(6))
    return trained_run(tmp_path_factory.mktemp("serve"), text, "--max-steps", "40", *TINY)


@pytest.fixture(scope="package")
def slow_run(tmp_path_factory) -> Path:
    """An untrained GPT whose context (32,768) lets one row decode for tens of seconds: a request that holds
    a batch row while a test looks at what waits beside it."""
    torch.manual_seed(0)
    tokenizer = CharTokenizer("To be, or not to be")
    config = pf.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=1 << 15, n_layers=1, n_heads=2, d_model=16,
                          d_ff=32)
    return pf.save_checkpoint(tmp_path_factory.mktemp("slow") / "slow", model=pf.GPT(config), family="gpt",
                              model_config=config.to_dict(), tokenizer=tokenizer)


class Server:
    """`plainformer serve ARGS` as a child process; `url` is its /v1 base, read from the line it logs, and
    `log()` what it logged since (read as it comes, so that the pipe never fills)."""

    def __init__(self, *args: str, preexec_fn: Callable[[], None] | None = None):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", "plainformer", "serve", "--port", "0", *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                        preexec_fn=preexec_fn)
        self.logged = ""  # what it logged up to the line that names its URL
        found = None
        while not found and (line := self.process.stderr.readline() if self.process.stderr else ""):
            self.logged += line
            found = re.search(r"at (http://\S+/v1)", line)
        if not found:
            self.process.kill()
            raise AssertionError(f"serve did not start: {self.logged}{self.process.communicate()[1]}")
        self.url = found.group(1)
        self.root = self.url.removesuffix("/v1")
        self.host, self.port = httpx.URL(self.root).host, httpx.URL(self.root).port
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._lines.append(line)

    def log(self) -> str:
        """What it logged after the line naming its URL, so far."""
        return "".join(self._lines)

    def health(self) -> dict:
        return httpx.get(f"{self.root}/health", timeout=5).json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """/health once no row decodes (a cancelled request's rows leave at the next step)."""
        return self.wait_for(lambda health: health["active_rows"] == 0, timeout)

    def wait_for(self, condition: Callable[[dict], bool], timeout: float = 10.0) -> dict:
        """/health once `condition` holds of it (or the last one, after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if condition(health) or time.monotonic() > deadline:
                return health
            time.sleep(0.02)

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=30)

    def stop(self, timeout: float = 15.0) -> tuple[int, str, str]:
        """SIGTERM, then (exit code, stdout, stderr after the first line)."""
        self.process.terminate()
        return self.wait(timeout)

    def wait(self, timeout: float = 15.0) -> tuple[int, str, str]:
        """(exit code, stdout, stderr after the first line) once it has exited."""
        assert self.process.stdout is not None
        self.process.wait(timeout=timeout)
        out = self.process.stdout.read()
        self._reader.join(timeout)
        return self.process.returncode, out, self.log()


def http_exchange(sock: socket.socket, request: bytes) -> tuple[int, bytes]:
    """Send `request` (raw HTTP), read until the server closes: (status, the whole answer)."""
    sock.sendall(request)
    answer = read_all(sock)
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, answer


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response (its headers name its length): (status, body); the connection may stay open."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(1 << 16) or b"\r\n\r\n"
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(1 << 16)
    return int(head.split(b" ", 2)[1]), body


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.fixture(scope="package")
def server(run) -> Iterator[Server]:
    running = Server("--ckpt", str(run), "--api-key", API_KEY, "--max-batch", "16", "--max-queue", "64")
    yield running
    code, out, err = running.stop()
    assert code == 0 and out == "" and "Traceback" not in err, (code, out, err)
