"""SentenceEncoder against sentence-transformers on the packaged all-MiniLM-L6-v2, mean pooling by hand,
batching and ordering, truncation, bf16, and loading a plainformer checkpoint."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F

from plainformer.checkpoint.format import save_checkpoint
from plainformer.data.tokenizers import WordPieceTokenizer
from plainformer.hf.bert import minilm_path
from plainformer.hf.sentence import SentenceEncoder, mean_pool
from plainformer.models.bert import BertConfig, BertForMaskedLM
from tests.reference.torch_reference import assert_close

SENTENCES = [
    "A rose by any other name would smell as sweet.",
    "Hi",
    "Ünïcödé café naïve résumé — Œuvre d’art, 3.14 % & co.",
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    "",
    "Brevity is the soul of wit.",
]
LONG = " ".join(["the lunatic, the lover and the poet are of imagination all compact"] * 40)


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path()), device="cpu")


@pytest.fixture(scope="module")
def encoder():
    return SentenceEncoder.from_pretrained("minilm")


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
def test_embeddings_equal_sentence_transformers(reference, backend):
    ours = SentenceEncoder.from_pretrained("minilm", backend=backend).encode(SENTENCES + [LONG], batch_size=4)
    theirs = reference.encode(SENTENCES + [LONG], batch_size=4, convert_to_tensor=True)
    assert_close(ours, theirs, f"embeddings ({backend})")


def test_exposes_the_bert_and_a_tokenizer_framing_cls_and_sep(encoder, reference):
    ids = encoder.tokenizer.encode("Brevity is the soul of wit.")
    assert ids[0] == encoder.tokenizer.cls_id and ids[-1] == encoder.tokenizer.sep_id
    assert ids == reference.tokenizer("Brevity is the soul of wit.")["input_ids"]
    assert encoder.bert.config.d_model == encoder.dim == 384
    assert encoder.max_len == reference.max_seq_length == 256


def test_long_sentences_are_truncated_like_sentence_transformers_keeping_sep(encoder, reference):
    ids = encoder.tokenize([LONG])[0]
    assert len(ids) == 256 and ids[-1] == encoder.tokenizer.sep_id
    expected = reference.tokenize([LONG])["input_ids"][0].tolist()
    assert ids == expected


def test_order_and_batch_size_do_not_change_the_embeddings(encoder):
    """Batchings differ only in the order of their sums, so the BERT runs in float64; mean_pool and the
    normalisation then take its states to float32 (encode returns float32): unit vectors, whose sums over
    tokens grouped by another padded length may round a few float32 ulps apart: 16 ulps of 1."""
    encoder = copy.deepcopy(encoder).double()
    tolerance = 16 * torch.finfo(torch.float32).eps
    one_batch = encoder.encode(SENTENCES, batch_size=32)
    small_batches = encoder.encode(SENTENCES, batch_size=2)
    one_by_one = torch.stack([encoder.encode(s) for s in SENTENCES])
    assert (small_batches - one_batch).abs().max().item() <= tolerance, "batch size 2 vs 32"
    assert (one_by_one - one_batch).abs().max().item() <= tolerance, "one at a time"


def test_embeddings_are_unit_vectors_in_float32(encoder):
    out = encoder.encode(SENTENCES)
    assert out.dtype == torch.float32 and out.shape == (len(SENTENCES), 384)
    assert_close(out.norm(dim=-1), torch.ones(len(SENTENCES)), "norms")
    assert encoder.encode([]).shape == (0, 384)


def test_mean_pool_averages_real_tokens_only():
    hidden = torch.arange(24, dtype=torch.float64).view(2, 3, 4)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    expected = torch.stack([hidden[0, :2].mean(0), hidden[1, 0]]).float()
    assert torch.equal(mean_pool(hidden, mask), expected)


def test_forward_equals_normalised_mean_of_the_last_hidden_state(encoder):
    batch = encoder.tokenizer.encode_batch(SENTENCES[:3])
    with torch.no_grad():
        hidden = encoder.bert(batch["input_ids"], batch["attention_mask"]).last_hidden_state.double()
        weights = batch["attention_mask"].unsqueeze(-1).double()
        expected = F.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1).float()
        assert_close(encoder(batch["input_ids"], batch["attention_mask"]), expected, "forward")


def test_bfloat16_stays_close_to_float32(encoder):
    full = encoder.encode(SENTENCES)
    half = encoder.encode(SENTENCES, dtype=torch.bfloat16)
    assert half.dtype == torch.float32
    cosine = (full * half).sum(-1)
    assert cosine.min() > 0.99


def test_loads_a_plainformer_checkpoint_of_a_masked_lm(tmp_path):
    tokenizer = WordPieceTokenizer.train(["the king is dead, long live the king"] * 20, vocab_size=40)
    config = BertConfig(vocab_size=tokenizer.vocab_size, max_len=16, n_layers=1, n_heads=2, d_model=8, d_ff=16)
    torch.manual_seed(0)
    model = BertForMaskedLM(config).eval()
    save_checkpoint(tmp_path / "ckpt", model=model, family=model.family, model_config=config.to_dict(),
                    tokenizer=tokenizer)
    encoder = SentenceEncoder.from_pretrained(tmp_path / "ckpt")
    ids = tokenizer.encode("long live the king")
    with torch.no_grad():
        expected = F.normalize(model.bert(torch.tensor([ids])).last_hidden_state.mean(1), dim=-1)[0]
    assert_close(encoder.encode("long live the king"), expected, "checkpoint encoder")
    assert encoder.max_len == 16


def test_bad_arguments_are_named(encoder):
    with pytest.raises(TypeError, match="sentences"):
        encoder.encode([1, 2])
    with pytest.raises(TypeError, match="sentences"):
        encoder.encode(None)
    with pytest.raises(ValueError, match="batch_size"):
        encoder.encode(["a"], batch_size=0)
    with pytest.raises(ValueError, match="dtype"):
        encoder.encode(["a"], dtype=torch.float64)
    with pytest.raises(ValueError, match="max_len"):
        SentenceEncoder(encoder.bert, encoder.tokenizer, max_len=1000)
    with pytest.raises(FileNotFoundError, match="no model directory"):
        SentenceEncoder.from_pretrained("no/such/dir")
