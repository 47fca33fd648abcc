"""`plainformer serve` as a process: SIGTERM or Ctrl-C while a request decodes is a clean exit 0 within
seconds; a port in use, a model that is not there, or a missing extra are one line and status 2."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from plainformer.cli import main

from .conftest import Server


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_a_request_decodes_stops_it_cleanly(run, stop):
    server = Server("--ckpt", str(run))
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    stream = client.completions.create(model="run", prompt="T", max_tokens=127, stream=True)
    next(iter(stream))
    threading.Thread(target=lambda: list(stream), daemon=True).start()  # keep reading what remains
    start = time.monotonic()
    server.process.send_signal(stop)
    out, err = server.process.communicate(timeout=15)
    assert server.process.returncode == 0, err
    assert time.monotonic() - start < 10 and out == "" and "Traceback" not in err
    assert '"decoding_steps"' in err  # its closing metrics line, on stderr


def test_a_port_in_use_is_one_line(run):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "plainformer", "serve", "--ckpt", str(run), "--port", str(port)],
                                capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"plainformer: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_a_missing_model_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "plainformer", "serve", "--ckpt", str(tmp_path / "nothing"),
                             "--port", "0"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_listening_beyond_loopback_without_a_key_is_warned_once(run):
    server = Server("--ckpt", str(run), "--host", "0.0.0.0")
    code, _, err = server.stop()
    assert "warning: listening on 0.0.0.0" in server.logged and code == 0


def test_an_int8_server_answers_as_sample_quantized_does(run, capsys):
    server = Server("--ckpt", str(run), "--quantize", "int8")
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        text = client.completions.create(model="run", prompt="To be", max_tokens=30, temperature=0).choices[0].text
    finally:
        assert server.stop()[0] == 0
    assert main(["sample", "--ckpt", str(run), "--quantize", "int8", "--prompt", "To be", "--max-new-tokens", "30",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "To be" + text + "\n"
