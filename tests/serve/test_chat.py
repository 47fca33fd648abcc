"""Chat prompts: a Hugging Face directory's chat_template, kept by our tokenizer through a checkpoint, renders
the messages as transformers' apply_chat_template does (in this process, and in the server's worker);
without one, the plain template. A served model's template that loops, builds gigabytes or computes for
seconds is refused with a 400 naming it while /health answers and SIGTERM stops the server; one that does
not compile is refused at start in one line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
from transformers import AutoTokenizer

import plainformer as pf
from plainformer.data.tokenizers import BPETokenizer, CharTokenizer, load_tokenizer
from plainformer.families.family import checkpoint_dir
from plainformer.families.gpt import load_language_model
from plainformer.hf.tokenizer_files import load_hf_tokenizer, save_hf_tokenizer
from plainformer.serve.chat import TemplateRenderer, chat_prompt
from plainformer.serve.protocol import APIError

from .conftest import API_KEY, Server

# ChatML with a system default, bos_token, a loop and a rule the messages may break.
TEMPLATE = ("{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
            "{% endif %}{% for message in messages %}{% if message['role'] == 'tool' %}"
            "{{ raise_exception('tool messages are not supported') }}{% endif %}"
            "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "To be, or not to be? "}, {"role": "assistant", "content": "That is it."},
            {"role": "user", "content": "Whether 'tis nobler"}]


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory):
    tokenizer = BPETokenizer.train("To be, or not to be, that is the question. " * 50, vocab_size=300)
    tokenizer.chat_template = TEMPLATE
    return save_hf_tokenizer(tokenizer, tmp_path_factory.mktemp("hf"))


def test_a_hf_chat_template_renders_as_transformers_renders_it(hf_directory):
    ours = load_hf_tokenizer(hf_directory)
    assert ours.chat_template == TEMPLATE
    theirs = AutoTokenizer.from_pretrained(hf_directory)
    expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat_prompt(ours, MESSAGES) == expected
    assert ours.encode_text(expected) == theirs(expected, add_special_tokens=False)["input_ids"]


def test_the_template_survives_a_checkpoints_tokenizer_files(hf_directory, tmp_path):
    load_hf_tokenizer(hf_directory).save(tmp_path)
    assert load_tokenizer(tmp_path).chat_template == TEMPLATE


def test_a_rule_of_the_template_is_a_400_naming_the_messages(hf_directory):
    with pytest.raises(APIError, match="tool messages are not supported") as raised:
        chat_prompt(load_hf_tokenizer(hf_directory), [{"role": "tool", "content": "42"}])
    assert raised.value.status == 400 and raised.value.param == "messages"


def test_without_a_template_each_turn_is_its_role_in_capitals():
    tokenizer = CharTokenizer("abc")
    assert chat_prompt(tokenizer, [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}]) == \
        "SYSTEM:\nbe\n\nUSER:\nhi\n\nASSISTANT:\n"


# ------------------------------------------------------------------------ a model directory's template, served

# A template with a branch for each way a model's template can hurt the server; else the plain one.
HOSTILE = """{% set first = messages[0].content %}
{% if first == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}
{% elif first == 'giga' %}{{ 'a' * 10**9 }}
{% elif first == 'ten-giga' %}{{ 'a' * 10**10 }}
{% elif first == 'power' %}{{ 10 ** (10**7) }}
{% elif first == 'long' %}{% for i in range(100000) %}{{ 'a' * 1000 }}{% endfor %}
{% elif first == 'boom' %}{{ raise_exception('boom ' ~ messages[1].content) }}
{% else %}{% for message in messages %}{{ message.role | upper }}:
{{ message.content }}

{% endfor %}ASSISTANT:
{% endif %}"""
TEMPLATE_TIMEOUT = 1


def with_template(run, directory: Path, template: str) -> Path:
    model, tokenizer = load_language_model(checkpoint_dir(run))
    tokenizer.chat_template = template
    return pf.save_checkpoint(directory, model=model, family="gpt", model_config=model.config.to_dict(),
                              tokenizer=tokenizer)


@pytest.fixture(scope="module")
def templated_run(run, tmp_path_factory) -> Path:
    return with_template(run, tmp_path_factory.mktemp("templated") / "templated", HOSTILE)


@pytest.fixture(scope="module")
def templated(templated_run) -> Iterator[Server]:
    running = Server("--ckpt", str(templated_run), "--timeout-template", str(TEMPLATE_TIMEOUT))
    yield running
    code, out, err = running.stop()
    assert code == 0 and out == "" and err.splitlines() == [err.splitlines()[-1]], err  # the metrics line alone


def chat(server: Server, *contents: str) -> httpx.Response:
    body = {"model": "templated", "messages": [{"role": "user", "content": c} for c in contents], "max_tokens": 8,
            "temperature": 0}
    return httpx.post(f"{server.url}/chat/completions", content=json.dumps(body).encode(),  # ASCII: "\ud800" escaped
                      headers={"Content-Type": "application/json"}, timeout=60)


def test_a_model_template_renders_in_its_worker_as_here(templated, server):
    client = openai.OpenAI(base_url=templated.url, api_key="none", max_retries=0)
    answer = client.chat.completions.create(model="templated", messages=[{"role": "user", "content": "To be"}],
                                            max_tokens=8, temperature=0)
    plain = openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0).chat.completions.create(
        model="run", messages=[{"role": "user", "content": "To be"}], max_tokens=8, temperature=0)
    assert answer.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(("content", "bound"), [
    ("loop", f"did not finish within {TEMPLATE_TIMEOUT} s"),
    ("giga", "needed more than 512 MiB of memory"),
    ("ten-giga", "needed more than 512 MiB of memory"),
    ("power", f"did not finish within {TEMPLATE_TIMEOUT} s"),
    ("long", "rendered more than 8388608 characters"),
])
def test_a_template_past_its_bounds_is_refused_naming_it_while_health_answers(templated, content, bound):
    answers = []
    start = time.monotonic()
    sender = threading.Thread(target=lambda: answers.append(chat(templated, content)))
    sender.start()
    while sender.is_alive():
        polled = time.monotonic()
        assert httpx.get(f"{templated.root}/health", timeout=5).status_code == 200
        assert time.monotonic() - polled < 1
    assert time.monotonic() - start < TEMPLATE_TIMEOUT + 3
    assert answers[0].status_code == 400
    error = answers[0].json()["error"]
    assert error["message"] == (f"the chat template of 'templated' {bound} rendering these messages: the request is "
                                "refused")
    assert (error["param"], error["code"]) == ("messages", "chat_template_limit")


def test_a_template_error_quoting_a_lone_surrogate_is_a_400(templated):
    answer = chat(templated, "boom", "\ud800")
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "the chat template of 'templated' refused the messages: boom \\ud800"


def test_sigterm_while_a_template_hangs_stops_the_server(templated_run):
    server = Server("--ckpt", str(templated_run), "--timeout-template", "60")
    answers = []
    sender = threading.Thread(target=lambda: answers.append(chat(server, "loop")))
    sender.start()
    server.wait_for(lambda health: health["requests"] == 1)
    time.sleep(0.3)  # rendering
    start = time.monotonic()
    code, out, err = server.stop()
    sender.join(10)
    assert code == 0 and "Traceback" not in err and time.monotonic() - start < 10, err
    assert answers[0].status_code == 503 and "shutting down" in answers[0].json()["error"]["message"]


def test_a_template_with_a_syntax_error_is_refused_at_start_in_one_line(run, tmp_path):
    broken = with_template(run, tmp_path / "broken", "{% for message in messages %}{{ message.content }}")
    result = subprocess.run([sys.executable, "-m", "plainformer", "serve", "--ckpt", str(broken), "--port", "0"],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"plainformer: error: the chat template of {broken} has a syntax error: line 1: Unexpected end of template. "
        "Jinja was looking for the following tags: 'endfor' or 'else'. The innermost block that needs to be closed "
        "is 'for'."]


def test_the_worker_renders_a_hf_template_as_transformers_does(hf_directory):
    renderer = TemplateRenderer(load_hf_tokenizer(hf_directory), "hf")
    renderer.start()
    try:
        rendered = asyncio.run(renderer.prompt(MESSAGES))
    finally:
        renderer.close()
    theirs = AutoTokenizer.from_pretrained(hf_directory)
    assert rendered == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
