"""`/v1/embeddings` of `plainformer serve`, driven by the official `openai` client: MiniLM's embeddings equal
what `plainformer embed` writes (floats and base64 alike, a text past max_len truncated as embed does it), a
GPT given --pooling embeds with the mean or the last of its final hidden states, a model that only embeds
answers the completion endpoints 400 naming `model`, bad inputs are 400s naming `input`, and a shortened embedding
(`dimensions`) is a unit vector again, as OpenAI's are."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx2 as httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from plainformer.cli import main
from plainformer.families.family import checkpoint_dir
from plainformer.families.gpt import load_language_model
from plainformer.serve.embeddings import shortened

from .conftest import Server

TEXTS = ["The king is dead.", "Fair is foul, and foul is fair.", "horse " * 300]  # the last past 256 tokens
TOLERANCE = 1e-5  # fp32 against `plainformer embed`'s own fp32 output


@pytest.fixture(scope="module")
def minilm() -> Iterator[Server]:
    running = Server("--ckpt", "minilm")
    yield running
    code, out, err = running.stop()
    assert code == 0 and out == "" and "Traceback" not in err, (code, out, err)


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> np.ndarray:
    """What `plainformer embed` writes for TEXTS."""
    path = tmp_path_factory.mktemp("embed") / "e.npy"
    assert main(["embed", "--npy", str(path), *TEXTS]) == 0
    return np.load(path)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_minilm_embeddings_equal_plainformer_embed(minilm, embedded, encoding_format):
    # the client asks for base64 and decodes it when no format is given; "float" is a JSON array
    answer = client_of(minilm).embeddings.create(model="minilm", input=TEXTS, encoding_format=encoding_format)
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == "minilm"
    got = np.array([d.embedding for d in answer.data]) if encoding_format == "float" else \
        np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in answer.data])
    np.testing.assert_allclose(got, embedded, atol=TOLERANCE, rtol=0)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 256


def test_the_clients_default_decodes_to_the_same_embedding(minilm, embedded):
    answer = client_of(minilm).embeddings.create(model="minilm", input=TEXTS[0])
    np.testing.assert_allclose(np.array(answer.data[0].embedding), embedded[0], atol=TOLERANCE, rtol=0)


def test_token_ids_embed_as_the_text_they_tokenize_to(minilm, embedded):
    ids = httpx.post(f"{minilm.root}/tokenize", json={"content": TEXTS[1], "add_special": True}, timeout=10).json()
    assert ids["tokens"][0] == 101 and ids["tokens"][-1] == 102  # [CLS] .. [SEP]
    answer = client_of(minilm).embeddings.create(model="minilm", input=[ids["tokens"]], encoding_format="float")
    np.testing.assert_allclose(np.array(answer.data[0].embedding), embedded[1], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("dimensions", [1, 8, 383])
def test_a_shortened_embedding_is_its_first_components_made_unit_length_again(minilm, embedded, dimensions):
    short = client_of(minilm).embeddings.create(model="minilm", input=TEXTS, dimensions=dimensions,
                                                encoding_format="float")
    got = np.array([d.embedding for d in short.data], dtype=np.float64)
    assert got.shape == (len(TEXTS), dimensions)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6, rtol=0)  # OpenAI's, issue 57
    head = embedded[:, :dimensions].astype(np.float64)
    np.testing.assert_allclose(got, head / np.linalg.norm(head, axis=1, keepdims=True), atol=TOLERANCE, rtol=0)


def test_shortened_divides_the_first_components_by_their_own_norm():
    vectors = F.normalize(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)), dim=1)
    head = vectors[:, :5].double()
    expected = head / head.pow(2).sum(dim=1, keepdim=True).sqrt()
    torch.testing.assert_close(shortened(vectors, 5).double(), expected, atol=1e-7, rtol=0)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"input": [[101] * 300]}, "input"),  # ids past max_len are not truncated behind the client's back
    ({"input": [[10**7]]}, "input"),
    ({"input": ""}, "input"),
    ({"input": "a", "dimensions": 1000}, "dimensions"),
])
def test_bad_inputs_are_400s_naming_the_field(minilm, kwargs, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client_of(minilm).embeddings.create(model="minilm", encoding_format="float", **kwargs)
    assert raised.value.body["param"] == param


def test_a_model_that_only_embeds_refuses_completions_naming_model(minilm):
    client = client_of(minilm)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="minilm", prompt="To be", max_tokens=2)
    assert raised.value.body["param"] == "model" and "/v1/embeddings" in raised.value.body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["param"] == "model"
    assert minilm.health()["active_rows"] == 0


@pytest.fixture(scope="module", params=["mean", "last"])
def pooled(request, run) -> Iterator[tuple[Server, str]]:
    running = Server("--ckpt", str(run), "--pooling", request.param)
    yield running, request.param
    code, out, err = running.stop()
    assert code == 0 and "Traceback" not in err, (code, out, err)


def test_a_gpt_with_a_pooling_embeds_its_final_hidden_states(pooled, run):
    server, pooling = pooled
    texts = ["To be, or not", "Whether 'tis nobler in the mind"]
    answer = client_of(server).embeddings.create(model="run", input=texts, encoding_format="float")
    model, tokenizer = load_language_model(checkpoint_dir(run))
    model = model.double().eval()
    for text, data in zip(texts, answer.data, strict=True):
        with torch.no_grad():
            h = model.norm(model.hidden_states(torch.tensor([tokenizer.encode(text)])))[0]  # (n, d_model)
        expected = F.normalize(h.mean(0) if pooling == "mean" else h[-1], dim=-1)
        np.testing.assert_allclose(np.array(data.embedding), expected.numpy(), atol=TOLERANCE, rtol=0)
    # and it still generates
    assert client_of(server).completions.create(model="run", prompt="To", max_tokens=2).usage.completion_tokens == 2
