"""Reading OpenAI requests: the defaults OpenAI documents, the forms a field may take, and the neutral values
of what this server cannot honour."""

from __future__ import annotations

import pytest

from plainformer.serve.protocol import (
    APIError,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_embeddings,
    parse_json,
    parse_tokenize,
)


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
    body = {"model": "m", "prompt": "a", "presence_penalty": 0, "frequency_penalty": 0.0,
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


@pytest.mark.parametrize("parse", [
    lambda b: parse_completion({**b, "prompt": "a"}, max_n=1),
    lambda b: parse_chat({**b, "messages": [{"role": "user", "content": "a"}]}, max_n=1),
], ids=["completion", "chat"])
def test_logit_bias_is_read_as_sorted_id_bias_pairs_on_both_endpoints(parse):
    body = {"model": "m", "logit_bias": {"12": -100, "3": 2.5, "7": 100}}
    assert parse(body).decoding.logit_bias == ((3, 2.5), (7, 100.0), (12, -100.0))


@pytest.mark.parametrize("bias", [[1, 2], {"a": 1}, {"-1": 1}, {"1.5": 1}, {"3": 100.01}, {"3": -101}, {"3": "1"},
                                  {"3": True}])
def test_a_logit_bias_that_is_no_map_of_ids_to_biases_in_range_is_a_400_naming_it(bias):
    with pytest.raises(APIError, match="logit_bias must map token ids") as raised:
        parse_completion({"model": "m", "prompt": "a", "logit_bias": bias}, max_n=1)
    assert (raised.value.status, raised.value.param) == (400, "logit_bias")


def test_embeddings_take_openais_inputs_and_formats():
    request = parse_embeddings({"model": "m", "input": ["a", "b"]})
    assert (request.inputs, request.encoding_format, request.dimensions) == (["a", "b"], "float", None)
    assert parse_embeddings({"model": "m", "input": [[1, 2]], "encoding_format": "base64"}).inputs == [[1, 2]]
    for body, param in [({"input": "a"}, "model"), ({"model": "m", "input": []}, "input"),
                        ({"model": "m", "input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({"model": "m", "input": ["a"] * 3}, "input")]:
        with pytest.raises(APIError) as raised:
            parse_embeddings(body, max_inputs=2)
        assert raised.value.param == param


def test_tokenize_and_detokenize_read_llama_cpps_fields():
    request = parse_tokenize({"content": "hi", "with_pieces": True})
    assert (request.content, request.add_special, request.with_pieces) == ("hi", False, True)
    assert parse_detokenize({"tokens": [1, 2]}) == [1, 2]
    for parse, body, param in [(parse_tokenize, {"content": 3}, "content"),
                               (parse_tokenize, {"content": "a", "add_special": 1}, "add_special"),
                               (parse_detokenize, {"tokens": ["a"]}, "tokens")]:
        with pytest.raises(APIError) as raised:
            parse(body)
        assert raised.value.param == param
