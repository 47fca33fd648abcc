"""Reading OpenAI requests: the defaults OpenAI documents, the forms a field may take, and the neutral values
of what this server cannot honour."""

from __future__ import annotations

import pytest

from plainformer.serve.protocol import APIError, parse_chat, parse_completion, parse_json


def test_a_completion_takes_openais_defaults():
    request = parse_completion({"model": "m", "prompt": "hi"}, max_n=4)
    decoding = request.decoding
    assert (decoding.max_tokens, decoding.temperature, decoding.n, decoding.stop, decoding.stream) == (16, 1.0, 1, (),
                                                                                                       False)
    assert (request.prompts, request.logprobs, request.echo) == (["hi"], None, False)


@pytest.mark.parametrize(("prompt", "prompts"), [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_a_prompt_is_a_text_texts_ids_or_lists_of_ids(prompt, prompts):
    assert parse_completion({"model": "m", "prompt": prompt}, max_n=1).prompts == prompts


def test_neutral_values_of_unsupported_fields_are_accepted():
    body = {"model": "m", "prompt": "a", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
            "best_of": 2, "n": 2, "suffix": None, "user": "someone", "an_unknown_field": 1}
    assert parse_completion(body, max_n=2).decoding.n == 2
    with pytest.raises(APIError, match="best_of is not supported") as raised:
        parse_completion({**body, "best_of": 3}, max_n=2)
    assert raised.value.param == "best_of"


def test_a_chat_reads_text_parts_and_max_completion_tokens():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]},
                                       {"role": "assistant", "content": None}],
            "max_completion_tokens": 7, "logprobs": True}
    request = parse_chat(body, max_n=1)
    assert request.messages == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]
    assert (request.decoding.max_tokens, request.top_logprobs) == (7, 0)
    assert parse_chat({"model": "m", "messages": body["messages"]}, max_n=1).decoding.max_tokens is None


@pytest.mark.parametrize("raw", [b"\xff", b"[" * 100_000, b'"text"'])
def test_a_body_that_is_no_json_object_is_a_400(raw):
    with pytest.raises(APIError) as raised:
        parse_json(raw)
    assert raised.value.status == 400
