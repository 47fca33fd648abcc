"""`plainformer serve` driven by the official `openai` client, as a user runs it: completions and chat
equal to what `GPT.generate` and `plainformer sample` give, streams that concatenate to the whole text,
echoed prompts scored by the model's own log-softmax, 16 concurrent clients each answered as if alone
(joining a running batch), and every bad request answered in OpenAI's error shape; /health answers within
a second whatever a request holds, and a client that leaves (mid-body, waiting, decoding) frees its
handler, its queue place and its row, with nothing in the log."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
import torch

import plainformer as pf
from plainformer.cli import main
from plainformer.data.tokenizers import CharTokenizer
from plainformer.families.family import checkpoint_dir
from plainformer.families.gpt import load_language_model
from plainformer.inference import for_decoding
from plainformer.serve.app import create_app
from plainformer.serve.service import Service

from .conftest import API_KEY, Server, read_response

MODEL = "run"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(run):
    """The served model as the server decodes with it (`for_decoding`), in this process."""
    model, tokenizer = load_language_model(checkpoint_dir(run))
    for_decoding(model)
    return model.eval(), tokenizer


def greedy(reference, prompt: str, new: int) -> str:
    model, tokenizer = reference
    ids = tokenizer.encode(prompt)
    return tokenizer.decode(model.generate(torch.tensor([ids]), new, temperature=0)[0, len(ids):].tolist())


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_completion_equals_generate(client, reference):
    answer = client.completions.create(model=MODEL, prompt="To be, or", max_tokens=30, temperature=0)
    assert answer.choices[0].text == greedy(reference, "To be, or", 30)
    assert answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len("To be, or"), 30)


def test_a_seeded_completion_equals_sample_with_that_seed(client, run, capsys):
    options = dict(temperature=0.9, top_p=0.95)
    answer = client.completions.create(model=MODEL, prompt="Whether", max_tokens=40, seed=5, extra_body={"top_k": 12},
                                       **options)
    assert main(["sample", "--ckpt", str(run), "--prompt", "Whether", "--max-new-tokens", "40", "--seed", "5",
                 "--temperature", "0.9", "--top-p", "0.95", "--top-k", "12"]) == 0
    assert "Whether" + answer.choices[0].text + "\n" == capsys.readouterr().out


def test_n_choices_are_the_samples_of_seed_plus_i(client, run, capsys):
    answer = client.completions.create(model=MODEL, prompt="To", max_tokens=20, n=3, seed=11, temperature=1.0)
    assert main(["sample", "--ckpt", str(run), "--prompt", "To", "--max-new-tokens", "20", "--seed", "11",
                 "--temperature", "1.0", "--num-samples", "3"]) == 0
    samples = capsys.readouterr().out.split("---\n")
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert ["To" + c.text + "\n" for c in answer.choices] == samples


def test_a_tiny_temperature_decodes_greedily_and_leaves_a_running_stream_alone(client):
    request = dict(model=MODEL, prompt="To be", max_tokens=60, seed=1, temperature=1.0)
    whole = client.completions.create(**request)
    stream = client.completions.create(**request, stream=True)
    first = next(iter(stream))  # the stream's row is in the batch now
    tiny = client.completions.create(model=MODEL, prompt="Whether", max_tokens=30, temperature=3e-38, seed=2)
    greedy = client.completions.create(model=MODEL, prompt="Whether", max_tokens=30, temperature=0)
    assert tiny.choices[0].text == greedy.choices[0].text
    rest = list(stream)
    assert first.choices[0].text + "".join(c.choices[0].text for c in rest) == whole.choices[0].text
    assert rest[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_the_largest_seed_with_two_prompts_of_two_choices_wraps_as_sample_does(client, run, capsys):
    answer = client.completions.create(model=MODEL, prompt=["To", "Whether"], max_tokens=12, n=2, seed=2**64 - 1,
                                       temperature=1.0)
    assert main(["sample", "--ckpt", str(run), "--prompt", "Whether", "--max-new-tokens", "12", "--seed", "1",
                 "--temperature", "1.0", "--num-samples", "2"]) == 0
    assert ["Whether" + c.text + "\n" for c in answer.choices[2:]] == capsys.readouterr().out.split("---\n")


def test_stream_chunks_concatenate_to_the_whole_text(client):
    request = dict(model=MODEL, prompt=["To be", "Whether 'tis"], max_tokens=25, seed=3, n=2, temperature=1.0)
    whole = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    texts = {c.index: "" for c in whole.choices}
    finish = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_a_stop_string_ends_the_text_before_it(client, reference):
    text = greedy(reference, "To be", 30)
    stop = text[8:11]
    answer = client.completions.create(model=MODEL, prompt="To be", max_tokens=30, temperature=0,
                                       stop=[stop, "never written"])
    assert answer.choices[0].text == text[:text.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="To be", max_tokens=30, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[:text.index(stop)]


def test_echo_scores_the_prompt_with_the_models_log_softmax(client, reference):
    model, tokenizer = reference
    text = "To be, or not to be"
    answer = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert answer.choices[0].text == text and logprobs.tokens == list(text)
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        logits = model(ids)[0][0].double()
    expected = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:], dtype=torch.float64), expected,
                               atol=1e-4, rtol=0)
    # the text's summed logprob is minus the summed next-token loss that `eval` averages
    loss = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")
    assert sum(logprobs.token_logprobs[1:]) == pytest.approx(-float(loss), abs=1e-4)
    assert logprobs.text_offset == list(range(len(text)))
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])


def test_token_id_prompts_as_lm_evaluation_harness_sends_them(client, reference):
    _, tokenizer = reference
    ids = [tokenizer.encode("To be"), tokenizer.encode("Whether")]
    answer = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert [c.text[:len(t)] for c, t in zip(answer.choices, ("To be", "Whether"), strict=True)] == ["To be", "Whether"]
    for choice, prompt in zip(answer.choices, ids, strict=True):
        assert len(choice.logprobs.token_logprobs) == len(prompt) + 1  # the prompt's, then the new token's
        new = choice.logprobs.token_logprobs[-1]
        assert new == pytest.approx(max(choice.logprobs.top_logprobs[-1].values()), abs=1e-6)  # greedy


def test_chat_renders_the_plain_template_and_answers_as_completions_would(client, reference):
    messages = [{"role": "user", "content": "To be, or not to be"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                            logprobs=True, top_logprobs=2)
    prompt = "USER:\nTo be, or not to be\n\nASSISTANT:\n"
    assert answer.choices[0].message.content == greedy(reference, prompt, 20)
    assert answer.choices[0].message.role == "assistant"
    content = answer.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 and entry.logprob == entry.top_logprobs[0].logprob for entry in content)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer.choices[0].message.content


def test_sixteen_concurrent_clients_each_get_their_answer_alone(client):
    prompts = ["To be", "Whether 'tis nobler in the mind", "T", "USER:\nTo be, or not", "ASSISTANT:\n"] * 4
    requests = [dict(model=MODEL, prompt=prompts[i], max_tokens=8 + 5 * i, temperature=0.0 if i % 2 else 0.8,
                     seed=i, stream=i % 3 == 0) for i in range(16)]

    def ask(request: dict) -> str:
        if request["stream"]:
            return "".join(c.choices[0].text for c in client.completions.create(**request))
        return client.completions.create(**request).choices[0].text

    alone = [ask(request) for request in requests]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, requests))
    assert together == alone


def test_requests_sent_while_a_long_one_decodes_join_it_and_finish_first(client, server):
    long = client.completions.create(model=MODEL, prompt="T", max_tokens=126, temperature=0, stream=True)
    first = next(iter(long))  # it decodes now
    assert first.choices[0].text is not None
    finished: list[float] = []

    def short(i: int) -> None:
        client.completions.create(model=MODEL, prompt="To be", max_tokens=2, seed=i)
        finished.append(time.monotonic())

    threads = [threading.Thread(target=short, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rest = list(long)
    long_done = time.monotonic()
    assert len(finished) == 4 and max(finished) < long_done and rest[-1].choices[0].finish_reason == "length"
    assert len(rest) > 4  # the long request was still decoding when the short ones ended


def test_health_answers_while_a_batch_decodes(client, server):
    stream = client.completions.create(model=MODEL, prompt="T", max_tokens=126, temperature=0, stream=True)
    next(iter(stream))
    health = httpx.get(f"{server.root}/health", timeout=5).json()
    assert health["status"] == "ok" and health["active_rows"] >= 1
    stream.close()
    assert server.wait_idle()["active_rows"] == 0


def test_a_client_that_disconnects_mid_stream_frees_its_row(server, client):
    with httpx.stream("POST", f"{server.url}/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "prompt": "T", "max_tokens": 126, "stream": True}, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    assert server.wait_idle()["active_rows"] == 0
    assert client.completions.create(model=MODEL, prompt="To", max_tokens=3).choices[0].finish_reason == "length"


# ------------------------------------------------------------------------------------------ errors


def post(server, path: str, body: bytes | dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30)


def assert_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert "Traceback" not in response.text
    return error


@pytest.mark.parametrize(("body", "param"), [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"model": MODEL, "prompt": "To", "max_tokens": "5"}, "max_tokens"),
    ({"model": MODEL, "prompt": "To", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "To", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "To", "logprobs": 6}, "logprobs"),
    ({"model": MODEL, "prompt": "To", "stop": [""]}, "stop"),
    ({"model": MODEL, "prompt": 7}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": [[1, 2], "To"]}, "prompt"),
    ({"model": MODEL, "prompt": [1, 999999]}, "prompt"),
    ({"model": MODEL, "prompt": "\u4e2d"}, "prompt"),
    ({"model": MODEL, "prompt": "To", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": MODEL, "prompt": "To", "presence_penalty": 1.0}, "presence_penalty"),
    ({"prompt": "To"}, "model"),
])
def test_a_malformed_completion_request_is_a_400_naming_the_field(server, body, param):
    assert_error(post(server, "/completions", body), 400, param)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
])
def test_a_malformed_chat_request_is_a_400_naming_the_field(server, body, param):
    assert_error(post(server, "/chat/completions", body), 400, param)


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-4", prompt="To", max_tokens=1)
    assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"max_tokens": 100, "prompt": "To be, or not to be, that is the question"}, "max_tokens", "at most 87"),
    ({"max_tokens": 1, "prompt": "T" * 129}, "prompt", "more than the model's context of 128"),
    ({"max_tokens": 1, "prompt": "To", "n": 17}, "n", "from 1 to 16"),
])
def test_what_the_context_or_the_batch_cannot_hold_is_a_400_naming_it(server, body, param, says):
    error = assert_error(post(server, "/completions", {"model": MODEL, **body}), 400, param)
    assert says in error["message"]


def test_a_body_over_the_limit_is_a_413(server):
    assert_error(post(server, "/completions", {"model": MODEL, "prompt": "T" * (5 << 20)}), 413, None)


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_a_missing_or_wrong_api_key_is_a_401(server, key):
    assert_error(post(server, "/completions", {"model": MODEL, "prompt": "To"}, key=key), 401, None)
    assert httpx.get(f"{server.url}/models", timeout=5).status_code == 401
    assert httpx.get(f"{server.root}/health", timeout=5).status_code == 200  # health asks no key


def test_an_unknown_route_is_a_404_in_openai_shape(server):
    assert_error(httpx.get(f"{server.url}/engines", timeout=5), 404, None)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("size", [5 << 20, 40 << 20])
def test_a_body_over_the_limit_is_answered_413_not_reset(server, size, chunked):
    body = json.dumps({"model": MODEL, "prompt": "T" * size}).encode()
    parts = [body[i:i + (1 << 16)] for i in range(0, len(body), 1 << 16)]
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(body)
    with server.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\n%s\r\n\r\n" % (API_KEY.encode(), framing))
        for part in parts:  # a reset would break this before the answer is read
            sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
        sock.sendall(b"0\r\n\r\n" if chunked else b"")
        status, answer = read_response(sock)
        assert status == 413 and json.loads(answer)["error"]["code"] == "request_too_large"
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the connection serves the next request
        assert read_response(sock)[0] == 200


def test_head_health_answers_200(server):
    response = httpx.head(f"{server.root}/health", timeout=5)
    assert response.status_code == 200 and response.content == b""


@pytest.mark.parametrize("echo", [False, True])
def test_a_stream_with_max_tokens_0_sends_its_choice_with_finish_reason_length(client, echo):
    whole = client.completions.create(model=MODEL, prompt="To be", max_tokens=0, echo=echo)
    chunks = list(client.completions.create(model=MODEL, prompt="To be", max_tokens=0, echo=echo, stream=True))
    choices = [choice for chunk in chunks for choice in chunk.choices]
    assert "".join(choice.text for choice in choices) == whole.choices[0].text == ("To be" if echo else "")
    assert [choice.finish_reason for choice in choices][-1] == whole.choices[0].finish_reason == "length"


def test_a_chat_stream_with_max_tokens_0_ends_with_finish_reason_length(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "To be"}],
                                                 max_tokens=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("prompt", [[[1]] * 65, ["a"] * 100_000])
def test_more_prompts_than_the_queue_holds_is_a_400_naming_prompt(client, prompt):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert raised.value.body["param"] == "prompt" and "at most 64" in raised.value.body["message"]


def test_health_answers_within_a_second_while_half_a_million_prompts_are_read(server):
    answers = []
    body = json.dumps({"model": MODEL, "prompt": [[1]] * 500_000, "max_tokens": 1}).encode()  # 2.5 MB
    sender = threading.Thread(target=lambda: answers.append(post(server, "/completions", body)))
    sender.start()
    waits = []
    while sender.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{server.root}/health", timeout=5).status_code == 200
        waits.append(time.monotonic() - start)
    sender.join()
    assert max(waits) < 1
    assert_error(answers[0], 400, "prompt")


def test_a_response_past_max_response_tokens_is_a_400_naming_n(client):
    prompts = ["To be, or not to be, that is the question"] * 64
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=prompts, n=16, echo=True, logprobs=5, max_tokens=16)
    assert raised.value.body["param"] == "n" and "--max-response-tokens" in raised.value.body["message"]


# ------------------------------------------------------------------------------ clients that leave


@pytest.fixture(scope="module")
def slow(slow_run) -> Iterator[Server]:
    """One row and one queue place, over a model whose row decodes for tens of seconds."""
    running = Server("--ckpt", str(slow_run), "--max-batch", "1", "--max-queue", "1")
    yield running
    code, out, err = running.stop()
    assert code == 0 and out == "" and err.splitlines()[-1].startswith('{"decoding_steps"'), err


def raw_completion(sock, stream: bool = False) -> None:
    body = json.dumps({"model": "slow", "prompt": "T", "max_tokens": 30000, "stream": stream}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def test_a_client_that_hangs_up_while_decoding_frees_its_handler_and_its_row(slow):
    with slow.connect() as sock:
        raw_completion(sock)
        assert slow.wait_for(lambda health: health["active_rows"] == 1)["requests"] == 1
    health = slow.wait_for(lambda health: health["requests"] == 0 and health["active_rows"] == 0, timeout=5)
    assert (health["requests"], health["active_rows"]) == (0, 0)


def test_a_queued_client_that_leaves_frees_its_place_for_the_next(slow):
    client = openai.OpenAI(base_url=slow.url, api_key="none", max_retries=0)
    holding = client.completions.create(model="slow", prompt="T", max_tokens=30000, stream=True)
    next(iter(holding))  # it holds the one row
    with slow.connect() as sock:
        raw_completion(sock)
        assert slow.wait_for(lambda health: health["queued"] == 1)["queued"] == 1  # the one place in the queue
    assert slow.wait_for(lambda health: health["queued"] == 0, timeout=5)["queued"] == 0
    waiting = client.completions.create(model="slow", prompt="T", max_tokens=3, stream=True)  # queued, not a 429
    assert slow.health()["queued"] == 1
    holding.close()
    assert [chunk.choices[0].finish_reason for chunk in waiting][-1] == "length"
    assert slow.wait_for(lambda health: health["requests"] == 0)["requests"] == 0


def test_a_client_that_leaves_mid_body_logs_nothing(slow):
    logged = len(slow.log())
    with slow.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        assert slow.wait_for(lambda health: health["requests"] == 1)["requests"] == 1
    assert slow.wait_for(lambda health: health["requests"] == 0)["requests"] == 0
    assert slow.log()[logged:] == ""


def test_a_bug_is_a_500_with_its_traceback_logged_once(capsys):
    tokenizer = CharTokenizer("abc")
    model = pf.GPT(pf.GPTConfig(vocab_size=3, block_size=8, n_layers=1, n_heads=1, d_model=8, d_ff=8)).eval()
    model.tokenizer = tokenizer
    service = Service(model, "tiny")

    def broken(prompt, param):
        raise RuntimeError("a bug")
    service.encode = broken  # type: ignore[method-assign]

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post("/v1/completions", json={"model": "tiny", "prompt": "ab"})

    response = asyncio.run(ask())
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "RuntimeError: a bug" in err


# ---------------------------------------------------------------------------- logit_bias, /tokenize, /detokenize


def biased_greedy(reference, prompt: str, new: int, bias: dict[int, float]) -> tuple[str, list[float]]:
    """Greedy decoding of z + bias by full forwards in float64, and log-softmax(z + bias) of each token drawn."""
    model, tokenizer = reference
    ids, logprobs = tokenizer.encode(prompt), []
    add = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    for token, b in bias.items():
        add[token] = b
    with torch.no_grad():
        for _ in range(new):
            logp = torch.log_softmax(model(torch.tensor([ids]))[0][0, -1].double() + add, dim=-1)
            ids.append(int(logp.argmax()))
            logprobs.append(float(logp.max()))
    return tokenizer.decode(ids[len(tokenizer.encode(prompt)):]), logprobs


def test_logit_bias_forces_and_bans_tokens_and_its_logprobs_include_the_bias(client, reference):
    _, tokenizer = reference
    prompt, new = "To be, or", 6
    forced = tokenizer.encode("W")[0]
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=new, temperature=0,
                                       logit_bias={str(forced): 100})
    assert answer.choices[0].text == "W" * new
    plain = greedy(reference, prompt, new)
    banned = {tokenizer.encode(plain[0])[0]: -100.0, tokenizer.encode(plain[1])[0]: -100.0}
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=new, temperature=0, logprobs=0,
                                       logit_bias={str(t): b for t, b in banned.items()})
    text, logprobs = biased_greedy(reference, prompt, new, banned)
    assert answer.choices[0].text == text and plain[0] not in text and plain[1] not in text
    assert answer.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-5)  # OpenAI's: biased
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "To be"}], max_tokens=3,
                                          temperature=0, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == "WWW"


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
@pytest.mark.parametrize("bias", [{"1000000": 1}, {"1": 101}, {"x": 1}])
def test_a_logit_bias_outside_the_vocabulary_or_range_is_a_400_naming_it(server, path, bias):
    body = {"model": MODEL, "max_tokens": 1, "logit_bias": bias, "prompt": "To",
            "messages": [{"role": "user", "content": "To"}]}
    assert_error(post(server, path, body), 400, "logit_bias")


def root_post(server, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.root}{path}", json=body, headers=headers, timeout=30)


def test_tokenize_and_detokenize_answer_in_llama_cpps_shape(server, reference):
    _, tokenizer = reference
    text = "To be, or not"
    tokens = root_post(server, "/tokenize", {"content": text}).json()
    assert tokens == {"tokens": tokenizer.encode(text)}
    pieces = root_post(server, "/tokenize", {"content": text, "with_pieces": True, "add_special": True}).json()
    assert pieces == {"tokens": [{"id": i, "piece": c} for i, c in zip(tokens["tokens"], text, strict=True)]}
    assert root_post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"content": text}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"content": ["a"]}, "content"),
    ("/tokenize", {"content": "a\u00e9\u4e2d"}, "content"),  # characters the vocabulary lacks
    ("/detokenize", {"tokens": [0, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": "To"}, "tokens"),
])
def test_bad_tokenize_and_detokenize_requests_are_400s_naming_the_field(server, path, body, param):
    assert_error(root_post(server, path, body), 400, param)


def test_tokenize_wants_the_api_key(server):
    assert_error(root_post(server, "/tokenize", {"content": "To"}, key=None), 401, None)


def test_a_gpt_served_without_a_pooling_refuses_embeddings_naming_model(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model=MODEL, input="To be")
    assert raised.value.body["param"] == "model" and "--pooling" in raised.value.body["message"]
