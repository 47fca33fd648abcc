"""A model trained here, and `plainformer serve` over it as a real process on a free loopback port."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import pytest

from tests.reference.runs import trained_run

API_KEY = "test-key"
TINY = ["--n-layers", "2", "--n-heads", "2", "--d-model", "32", "--d-ff", "64", "--block-size", "128",
        "--batch-size", "4", "--eval-interval", "20", "--eval-batches", "2", "--warmup-steps", "2"]


@pytest.fixture(scope="package")
def run(tmp_path_factory) -> Path:
    text = "\n\n".join(f"USER:\nTo be, or not to be, that is the question {i}.\n\nASSISTANT:\n"
                       f"Whether 'tis nobler in the mind to suffer {i}.\n" * 8 for i in range(6))
    return trained_run(tmp_path_factory.mktemp("serve"), text, "--max-steps", "40", *TINY)


class Server:
    """`plainformer serve ARGS` as a child process; `url` is its /v1 base, read from the line it logs."""

    def __init__(self, *args: str):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", "plainformer", "serve", "--port", "0", *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
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

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """/health once no row decodes (a cancelled request's rows leave at the next step)."""
        deadline = time.monotonic() + timeout
        while True:
            health = httpx.get(f"{self.root}/health").json()
            if health["active_rows"] == 0 or time.monotonic() > deadline:
                return health
            time.sleep(0.02)

    def stop(self, timeout: float = 15.0) -> tuple[int, str, str]:
        """SIGTERM, then (exit code, stdout, stderr after the first line)."""
        self.process.terminate()
        out, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, out, err


@pytest.fixture(scope="package")
def server(run) -> Iterator[Server]:
    running = Server("--ckpt", str(run), "--api-key", API_KEY, "--max-batch", "16", "--max-queue", "64")
    yield running
    code, out, err = running.stop()
    assert code == 0 and out == "" and "Traceback" not in err, (code, out, err)
