"""`plainformer serve` as a process: a stop (SIGTERM, or Ctrl-C twice) ends every open stream with an error
event and [DONE] and exits 0 within seconds; connections that stay silent, or send half a request, are
timed out, and one past --max-connections is refused with a 503; the open-file limit is raised to its hard
limit, and accept() failing for want of files is logged once with a count; a port in use, a model that
is not there, or a missing extra are one line and status 2 (the refusals at start run one after another in
one child process, each with its own stdout and stderr: an interpreter and torch started once, not per case)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest

from plainformer.cli import main

from .conftest import Server, http_exchange, read_all

SLOW = "slow"  # the slow run's model id
TIMEOUT = 1  # the limited server's --timeout-headers, --timeout-body and --timeout-keep-alive
MAX_CONNECTIONS = 4


def open_stream(server: Server, lines: list[str]) -> threading.Thread:
    """A stream of the slow model read line by line into `lines` on a thread of its own."""
    def read() -> None:
        body = {"model": SLOW, "prompt": "T", "max_tokens": 30000, "stream": True}
        with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as response:
            lines.append(str(response.status_code))
            lines.extend(line for line in response.iter_lines() if line)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT], [signal.SIGINT, signal.SIGINT]],
                         ids=["sigterm", "sigint", "sigint-twice"])
def test_a_stop_ends_every_open_stream_with_an_error_event_then_done(slow_run, signals):
    # one signal with no grace; or a grace of a minute that the second Ctrl-C cuts short
    grace = "0" if len(signals) == 1 else "60"
    server = Server("--ckpt", str(slow_run), "--max-batch", "2", "--timeout-shutdown", grace)
    streams = [[] for _ in range(5)]  # 2 decode, 3 wait for a row
    threads = [open_stream(server, lines) for lines in streams]
    server.wait_for(lambda health: health["active_rows"] == 2 and health["queued"] == 3)
    start = time.monotonic()
    for sig in signals:
        server.process.send_signal(sig)
        time.sleep(0.3)
    code, out, err = server.wait()
    for thread in threads:
        thread.join(10)
    assert code == 0 and out == "" and "Traceback" not in err, err
    assert time.monotonic() - start < 10
    for lines in streams:
        assert lines[0] == "200" and lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "shutting down" in error["message"] and error["type"] == "server_error"
    assert '"decoding_steps"' in err  # its closing metrics line, on stderr


def test_the_official_client_sees_the_stop_as_an_error(slow_run):
    server = Server("--ckpt", str(slow_run), "--max-batch", "1", "--timeout-shutdown", "0")
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    stream = client.completions.create(model=SLOW, prompt="T", max_tokens=30000, stream=True)
    next(iter(stream))
    server.process.terminate()
    with pytest.raises(openai.APIError, match="shutting down"):
        list(stream)
    code, _, err = server.wait()
    assert code == 0 and "Traceback" not in err


# ------------------------------------------------------------------------------ connections


@pytest.fixture(scope="module")
def limited(run) -> Iterator[Server]:
    running = Server("--ckpt", str(run), "--max-connections", str(MAX_CONNECTIONS), "--timeout-headers", str(TIMEOUT),
                     "--timeout-body", str(TIMEOUT), "--timeout-keep-alive", str(TIMEOUT))
    yield running
    code, out, err = running.stop()
    assert code == 0 and out == "" and "Traceback" not in err, (code, out, err)


def timed_read(sock: socket.socket) -> tuple[bytes, float]:
    start = time.monotonic()
    return read_all(sock), time.monotonic() - start


def test_a_silent_connection_is_closed_after_the_header_timeout(limited):
    with limited.connect() as sock:
        answer, waited = timed_read(sock)
    assert answer == b"" and TIMEOUT * 0.9 < waited < TIMEOUT + 3


@pytest.mark.parametrize(("request_", "stage"), [
    (b"GET /health HTTP/1.1\r\nHost: x\r\n", "headers"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
     b'{"model": ', "body"),
])
def test_half_a_request_is_answered_408_when_its_time_is_up(limited, request_, stage):
    with limited.connect() as sock:
        sock.sendall(request_)
        answer, waited = timed_read(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and TIMEOUT * 0.9 < waited < TIMEOUT + 3
    assert json.loads(body)["error"]["message"] == f"the request's {stage} did not arrive within {TIMEOUT} s"
    assert limited.wait_for(lambda health: health["requests"] == 0)["requests"] == 0  # its handler has ended


def test_an_idle_keep_alive_connection_is_closed(limited):
    with limited.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer, waited = timed_read(sock)
    assert answer.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in answer and waited < TIMEOUT + 3


def test_a_connection_past_the_limit_is_refused_and_health_answers_once_the_silent_ones_time_out(limited):
    silent = [limited.connect() for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.2)  # accepted
    try:
        with limited.connect() as sock:
            status, answer = http_exchange(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 503 and b"Retry-After: 1" in answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
        start = time.monotonic()
        while httpx.get(f"{limited.root}/health", timeout=5).status_code != 200:
            time.sleep(0.05)
        assert time.monotonic() - start < TIMEOUT + 3
    finally:
        for sock in silent:
            sock.close()
    assert limited.log().count("refused a connection") == 1


def test_the_file_limit_is_raised_and_accept_failing_is_one_line_with_a_count(run):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(hard, 256)
    server = Server("--ckpt", str(run), "--max-connections", "32",
                    preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
    pid = server.process.pid
    assert resource.prlimit(pid, resource.RLIMIT_NOFILE)[0] == hard
    open_fds = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    lowest_free = min(set(range(len(open_fds) + 1)) - open_fds)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free, hard))  # no file more: accept() fails
    clients = [server.connect() for _ in range(3)]
    time.sleep(2.5)  # asyncio retries every second
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (hard, hard))
    for sock in clients:
        with sock:
            assert http_exchange(sock, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")[0] == 200
    code, _, err = server.stop()  # within a second of the failures: asyncio's retries find the socket closed
    lines = [line for line in err.splitlines() if "out of system resource" in line]
    assert code == 0 and "Traceback" not in err, err
    assert lines[0] == "plainformer serve: socket.accept() out of system resource: [Errno 24] Too many open files"
    assert len(lines) == 2 and int(lines[1].rpartition("again ")[2].split()[0]) >= 2, lines


# ------------------------------------------------------------------------------ refused at start

# `plainformer serve ARGV` for each case of argv[1] (JSON {case: ARGV}), one after another in this one process,
# file descriptors 1 and 2 of each its own: {case: [exit status, stdout, stderr]} on stdout at the end.
REFUSALS_CHILD = r"""
import json, os, sys, tempfile
from plainformer.cli import main

def serve(argv):
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        kept = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = main(["serve", *argv])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(kept[0], 1)
            os.dup2(kept[1], 2)
        out.seek(0)
        err.seek(0)
        return [code, out.read(), err.read()]

print(json.dumps({case: serve(argv) for case, argv in json.loads(sys.argv[1]).items()}))
"""
API_KEYS = ("", "clé-secrète", "two words")
BAD_PREFIX_CACHE_SIZES = ("-1", "ten", "nan", "inf")
TOO_LARGE_PREFIX_CACHES = [
    ("1e30", None, r"--prefix-cache-mb 1e\+30 is more than the [\d.]+ [kMGT]B available once the model is loaded: at "
                   r"most \d+ \(--max-memory SIZE to allow more\)$"),
    ("1" * 26, None, r"--prefix-cache-mb 1\.11111e\+25 is more than the [\d.]+ [kMGT]B available"),
    ("2000", "1GB", r"--prefix-cache-mb 2000 is more than the 1\.0 GB allowed once the model is loaded: at most 1000$"),
]
BERT_FLAGS = [["--pooling", "last"], ["--quantize", "int8"]]


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    """A loopback port another socket listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        yield taken.getsockname()[1]


@pytest.fixture(scope="module")
def refusals(run, taken_port, tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """{case: (exit status, stdout, stderr)} of `plainformer serve` refusing to start, every case in one child."""
    cases = {f"--api-key {key}": ["--ckpt", str(run), "--port", "0", "--api-key", key] for key in API_KEYS}
    cases["port in use"] = ["--ckpt", str(run), "--port", str(taken_port)]
    cases["missing model"] = ["--ckpt", str(tmp_path_factory.mktemp("missing") / "nothing"), "--port", "0"]
    cases.update({f"bert {flag[0]}": ["--ckpt", "minilm", "--port", "0", *flag] for flag in BERT_FLAGS})
    cases.update({f"--prefix-cache-mb={value}": ["--ckpt", str(run), "--port", "0", f"--prefix-cache-mb={value}"]
                  for value in BAD_PREFIX_CACHE_SIZES})
    for value, limit, _ in TOO_LARGE_PREFIX_CACHES:
        limited = [] if limit is None else [f"--max-memory={limit}"]
        cases[f"--prefix-cache-mb={value} {limit}"] = ["--ckpt", str(run), "--port", "0", f"--prefix-cache-mb={value}",
                                                       *limited]
    child = subprocess.run([sys.executable, "-c", REFUSALS_CHILD, json.dumps(cases)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.returncode == 0 and child.stderr == "", child.stderr[-3000:]
    return {case: tuple(result) for case, result in json.loads(child.stdout).items()}


def test_an_empty_or_non_ascii_api_key_is_refused_at_start_in_one_line(refusals):
    for key in API_KEYS:
        code, out, err = refusals[f"--api-key {key}"]
        assert code == 2 and out == ""
        assert err.strip().splitlines() == [
            "plainformer: error: argument --api-key: expected printable ASCII without spaces, which an HTTP header "
            "can carry (see `plainformer serve --help`)"]


def test_a_port_in_use_is_one_line(refusals, taken_port):
    code, out, err = refusals["port in use"]
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"plainformer: error: cannot listen on 127.0.0.1:{taken_port}: Address already in use"]


def test_a_missing_model_is_one_line(refusals):
    code, _, err = refusals["missing model"]
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_listening_beyond_loopback_without_a_key_is_warned_once(run):
    server = Server("--ckpt", str(run), "--host", "0.0.0.0")
    code, _, _ = server.stop()
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


@pytest.mark.parametrize("flag", BERT_FLAGS)
def test_a_gpts_flag_given_with_a_bert_is_one_line(flag, refusals):
    code, out, err = refusals[f"bert {flag[0]}"]
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"plainformer: error: {flag[0]} is for a GPT; minilm holds a BERT, which embeds as plainformer embed does "
        "(mean pooling)"]


SYSTEM = "USER:\nTo be, or not to be, that is the question. Whether 'tis nobler in the mind "  # a shared prefix


def answers(server: Server, prompts: list[str], *, concurrently: bool) -> list[tuple[str, list[float]]]:
    """Each prompt's completion (text, token log-probabilities) from the official client: one request after
    another, or all at once from a thread each. Odd prompts are greedy, even ones seeded samples."""
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)

    def ask(i: int) -> tuple[str, list[float]]:
        choice = client.completions.create(model="run", prompt=prompts[i], max_tokens=12, logprobs=0, seed=i,
                                           temperature=0.0 if i % 2 else 0.9).choices[0]
        return choice.text, choice.logprobs.token_logprobs

    if not concurrently:
        return [ask(i) for i in range(len(prompts))]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(ask, range(len(prompts))))


def closing_metrics(server: Server) -> dict:
    code, _, err = server.stop()
    assert code == 0, err
    return json.loads(err.splitlines()[-1])


def test_16_concurrent_requests_equal_their_solo_answers_with_and_without_the_prefix_cache(run):
    # a shared prefix and suffixes of different lengths: the 16 are prefilled together, padded, and once
    # cached each reuses the prefix (the second round its whole prompt but the last token)
    prompts = [SYSTEM + f"{i % 6} " + "to be " * (i // 6) + "or not"[:1 + i % 6] + ".\n\nASSISTANT:\n"
               for i in range(16)]
    solo_server = Server("--ckpt", str(run), "--prefix-cache-mb", "0")
    try:
        solo = answers(solo_server, prompts, concurrently=False)
    finally:
        assert closing_metrics(solo_server)["prefix_cache_hits"] == 0
    server = Server("--ckpt", str(run), "--max-batch", "16", "--prefix-cache-mb", "50")
    try:
        rounds = [answers(server, prompts, concurrently=True) for _ in range(2)]
    finally:
        hits = closing_metrics(server)["prefix_cache_hits"]
    assert "a prefix cache of 50.0 MB" in server.logged and "no prefix cache" in solo_server.logged
    assert hits >= 16
    for together in rounds:
        for (text, logprobs), (solo_text, solo_logprobs) in zip(together, solo, strict=True):
            assert text == solo_text
            assert max(abs(a - b) for a, b in zip(logprobs, solo_logprobs, strict=True)) <= 1e-5


@pytest.mark.parametrize("value", BAD_PREFIX_CACHE_SIZES)
def test_a_bad_prefix_cache_size_is_refused_in_one_line(value, refusals):
    code, out, err = refusals[f"--prefix-cache-mb={value}"]
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plainformer: error: argument --prefix-cache-mb:"), lines
    assert "finite number >= 0" in lines[0]


@pytest.mark.parametrize("value, limit, message", TOO_LARGE_PREFIX_CACHES)
def test_a_prefix_cache_larger_than_the_memory_is_refused_in_one_line(value, limit, message, refusals):
    code, out, err = refusals[f"--prefix-cache-mb={value} {limit}"]
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.match("plainformer: error: " + message, lines[0]), lines
