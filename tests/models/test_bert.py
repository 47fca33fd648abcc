"""BERT against Hugging Face transformers with copied weights: encoder, MLM head, classifier; config
checks, presets and the bad-input table."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
import transformers

import plainformer as pf
from plainformer.constants import IGNORE_INDEX
from plainformer.hf.bert import bert_config_to_hf, bert_name_map, bert_state_from_hf
from plainformer.models.bert import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
)
from tests.reference.torch_reference import assert_close

TINY = dict(vocab_size=61, max_len=20, type_vocab_size=2, n_layers=2, n_heads=4, d_model=32, d_ff=48,
            pad_id=0)
BACKENDS = ["math", "sdpa", "flash"]


def _config(**overrides) -> BertConfig:
    return BertConfig(**{**TINY, **overrides})


def _hf_config(config: BertConfig, **extra) -> transformers.BertConfig:
    return transformers.BertConfig(**bert_config_to_hf(config), **extra)


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Random values everywhere (biases and LayerNorm too), so that no parameter hides behind a 0 or 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)


def _copy_encoder(ours: BertModel, hf: transformers.BertModel) -> None:
    """Every weight of ours from hf; only the pooler may be absent (HF's masked LM has none)."""
    result = ours.load_state_dict(bert_state_from_hf(hf.state_dict(), ours.config.n_layers), strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"pooler.dense.weight", "pooler.dense.bias"}
    assert hf.pooler is None or not result.missing_keys


def _batch(batch: int = 3, n: int = 9, seed: int = 1, vocab_size: int = TINY["vocab_size"]):
    """ids, a padding mask with rows of different lengths (one unpadded), token types A then B."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (batch, n), generator=generator)
    lengths = torch.tensor([n, n - 3, 2][:batch])
    mask = torch.arange(n)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~mask, 0)
    types = (torch.arange(n)[None, :] >= (lengths[:, None] // 2)).long() & mask.long()
    return ids, mask, types


def _pair(dtype=torch.float32, backend="sdpa", **overrides):
    config = _config(dropout=0.0, attention_dropout=0.0, backend=backend, **overrides)
    hf = transformers.BertModel(_hf_config(config), add_pooling_layer=True).eval()
    _randomize(hf)
    ours = BertModel(config).eval()
    _copy_encoder(ours, hf)
    return ours.to(dtype), hf.to(dtype)


# ----------------------------------------------------------------------------- encoder

@pytest.mark.parametrize("backend", BACKENDS)
def test_encoder_matches_transformers_bert_model_at_real_tokens(backend):
    ours, hf = _pair(backend=backend)
    ids, mask, types = _batch()
    with torch.no_grad():
        out = ours(ids, mask, types)
        ref = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types)
    assert_close(out.last_hidden_state[mask], ref.last_hidden_state[mask], "last_hidden_state")
    assert_close(out.pooler_output, ref.pooler_output, "pooler_output")
    assert out[0] is out.last_hidden_state


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_encoder_matches_transformers_in_float64_everywhere_padding_included(backend):
    ours, hf = _pair(torch.float64, backend=backend)
    ids, mask, types = _batch()
    with torch.no_grad():
        out = ours(ids, mask, types)
        ref = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types)
    assert_close(out.last_hidden_state, ref.last_hidden_state, "last_hidden_state (fp64)")


def test_encoder_gradients_match_transformers_in_train_mode_without_dropout():
    ours, hf = _pair()
    ours.train(), hf.train()
    ids, mask, types = _batch()
    ours(ids, mask, types).last_hidden_state[mask].square().mean().backward()
    hf_out = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types)
    hf_out.last_hidden_state[mask].square().mean().backward()
    hf_names = {ours_name: hf_name for hf_name, ours_name in bert_name_map(ours.config.n_layers).items()}
    hf_params = dict(hf.named_parameters())
    for name, parameter in ours.named_parameters():
        if name.startswith("pooler."):
            continue  # the pooler is not in this loss
        assert_close(parameter.grad, hf_params[hf_names[name]].grad, f"grad of {name}")


def test_default_attention_mask_is_input_ids_not_pad_id():
    ours, _ = _pair()
    ids, mask, types = _batch()
    with torch.no_grad():
        assert torch.equal(ours(ids, None, types).last_hidden_state, ours(ids, mask, types).last_hidden_state)


def test_padding_does_not_change_the_real_tokens_outputs():
    ours, _ = _pair(torch.float64)  # padded vs alone differ only in summation order: float64, 1e-10
    ids, mask, _ = _batch()
    with torch.no_grad():
        batched = ours(ids, mask).last_hidden_state
        alone = ours(ids[1:2, :int(mask[1].sum())]).last_hidden_state
    assert_close(batched[1, :alone.shape[1]], alone[0], "row 1 alone vs padded")


def test_layers_are_the_foundation_encoder_layer_post_ln_with_config_eps():
    model = BertModel(_config(norm_eps=1e-12))
    for layer in model.layers:
        assert isinstance(layer, pf.EncoderLayer) and not layer.norm_first
        assert isinstance(layer.self_attn, pf.MultiHeadAttention)
        assert layer.norm1.eps == 1e-12 and layer.ff.activation == "gelu"
    assert isinstance(model.embeddings.position, pf.LearnedPositionalEmbedding)


def test_relu2_from_the_shared_activations_reaches_every_feed_forward():
    model = BertModel(_config(activation="relu2"))
    assert [layer.ff.activation for layer in model.layers] == ["relu2"] * len(model.layers)


def test_base_preset_has_bert_base_parameter_count():
    # bert-base-uncased's BertModel (with pooler) has 109,482,240 parameters.
    config = BertConfig.from_preset("base")
    with torch.device("meta"):
        model = BertModel(config)
    assert sum(p.numel() for p in model.parameters()) == 109_482_240
    assert (config.n_layers, config.d_model, config.n_heads, config.d_ff, config.norm_eps) == \
        (12, 768, 12, 3072, 1e-12)


def test_minilm_preset_matches_the_packaged_config():
    import json

    from plainformer.hf.bert import bert_config_from_hf, minilm_path
    packaged = bert_config_from_hf(json.loads((minilm_path() / "config.json").read_text()))
    assert packaged == BertConfig.from_preset("minilm-l6")


def test_initialisation_is_bert_normal_002_zero_bias_unit_norm():
    torch.manual_seed(0)
    model = BertModel(_config(d_model=64, d_ff=256, vocab_size=4000))
    weight = model.layers[0].ff.W_1.weight
    assert abs(weight.std().item() - 0.02) < 0.002
    assert torch.all(model.layers[0].ff.W_1.bias == 0)
    assert torch.all(model.embeddings.norm.weight == 1)
    assert torch.all(model.embeddings.word.weight[0] == 0)  # the padding row


# ----------------------------------------------------------------------------- heads

def _copy_mlm(ours: BertForMaskedLM, hf: transformers.BertForMaskedLM) -> None:
    _copy_encoder(ours.bert, hf.bert)
    state = hf.state_dict()
    with torch.no_grad():
        ours.head.dense.weight.copy_(state["cls.predictions.transform.dense.weight"])
        ours.head.dense.bias.copy_(state["cls.predictions.transform.dense.bias"])
        ours.head.norm.weight.copy_(state["cls.predictions.transform.LayerNorm.weight"])
        ours.head.norm.bias.copy_(state["cls.predictions.transform.LayerNorm.bias"])
        ours.head.bias.copy_(state["cls.predictions.bias"])


def _mlm_pair():
    config = _config(dropout=0.0, attention_dropout=0.0)
    hf = transformers.BertForMaskedLM(_hf_config(config, tie_word_embeddings=True)).eval()
    _randomize(hf)
    assert hf.cls.predictions.decoder.weight is hf.bert.embeddings.word_embeddings.weight
    ours = BertForMaskedLM(config).eval()
    _copy_mlm(ours, hf)
    return ours, hf


def _labels(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    chosen = (torch.arange(ids.numel()).view(ids.shape) % 3 == 0) & mask
    return torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))


def test_masked_lm_logits_and_loss_match_transformers():
    ours, hf = _mlm_pair()
    ids, mask, types = _batch()
    labels = _labels(ids, mask)
    with torch.no_grad():
        full, none = ours(ids, mask, types)
        selected, loss = ours(ids, mask, types, labels=labels)
        ref = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types, labels=labels)
    assert none is None
    assert_close(full[mask], ref.logits[mask], "logits")
    assert_close(selected, ref.logits[labels != IGNORE_INDEX], "logits at the labelled positions")
    assert_close(loss, ref.loss, "loss")


def test_masked_lm_decoder_is_the_word_embedding_with_its_own_bias():
    ours, _ = _mlm_pair()
    names = {name for name, _ in ours.named_parameters()}
    assert "head.bias" in names and not any("decoder" in name for name in names)
    ids, mask, types = _batch()
    _, loss = ours(ids, mask, types, labels=_labels(ids, mask))
    loss.backward()
    word = ours.bert.embeddings.word.weight
    # Rows of tokens absent from the input still get a gradient: only through the tied decoder.
    absent = sorted(set(range(1, word.shape[0])) - set(ids.flatten().tolist()))
    assert word.grad[absent].abs().sum() > 0


def test_masked_lm_loss_is_the_mean_over_labelled_positions_only():
    ours, _ = _mlm_pair()
    ids, mask, types = _batch()
    labels = _labels(ids, mask)
    full, _ = ours(ids, mask, types)
    _, loss = ours(ids, mask, types, labels=labels)
    keep = labels != IGNORE_INDEX
    expected = F.cross_entropy(full[keep].double(), labels[keep], reduction="sum") / keep.sum()
    assert abs(loss.item() - expected.item()) <= 1e-5


def test_masked_lm_with_no_labelled_position_gives_zero_loss_and_a_backward():
    ours, _ = _mlm_pair()
    ids, mask, _ = _batch()
    logits, loss = ours(ids, mask, labels=torch.full_like(ids, IGNORE_INDEX))
    assert logits.shape == (0, TINY["vocab_size"]) and loss.item() == 0.0
    loss.backward()


def test_sequence_classification_matches_transformers():
    config = _config(dropout=0.0, attention_dropout=0.0, n_labels=3)
    hf = transformers.BertForSequenceClassification(_hf_config(config, num_labels=3)).eval()
    _randomize(hf)
    ours = BertForSequenceClassification(config).eval()
    _copy_encoder(ours.bert, hf.bert)
    with torch.no_grad():
        ours.classifier.weight.copy_(hf.classifier.weight)
        ours.classifier.bias.copy_(hf.classifier.bias)
        ids, mask, types = _batch()
        labels = torch.tensor([0, 2, 1])
        logits, loss = ours(ids, mask, types, labels=labels)
        ref = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types, labels=labels)
    assert_close(logits, ref.logits, "logits")
    assert_close(loss, ref.loss, "loss")


def test_families_and_configs_are_exposed_for_the_trainer():
    assert (BertModel.family, BertForMaskedLM.family, BertForSequenceClassification.family) == \
        ("bert", "bert-mlm", "bert-cls")
    config = _config()
    assert BertForMaskedLM(config).config is config
    assert BertConfig.from_json(config.to_json()) == config


# ----------------------------------------------------------------------------- bad input

BAD_CONFIGS = [
    (dict(d_model=30, n_heads=4), ValueError, "divisible"),
    (dict(n_layers=0), ValueError, "n_layers"),
    (dict(pad_id=61), ValueError, "pad_id"),
    (dict(activation="tanh"), ValueError, "activation"),
    (dict(norm_eps=0.0), ValueError, "norm_eps"),
    (dict(dropout=1.5), ValueError, "dropout"),
    (dict(backend="fast"), ValueError, "backend"),
    (dict(type_vocab_size=0), ValueError, "type_vocab_size"),
    (dict(n_labels=1.5), TypeError, "n_labels"),
]


@pytest.mark.parametrize("overrides, error, word", BAD_CONFIGS)
def test_bad_config_raises_naming_the_field(overrides, error, word):
    with pytest.raises(error, match=word):
        _config(**overrides)


def _bad_calls():
    ids, mask, types = _batch()
    return [
        ("ids out of vocabulary", dict(input_ids=ids + 100), ValueError, "input_ids"),
        ("ids too long", dict(input_ids=torch.ones(1, 21, dtype=torch.long)), ValueError, "max_len"),
        ("float ids", dict(input_ids=ids.float()), TypeError, "input_ids"),
        ("ids of rank 1", dict(input_ids=ids[0]), ValueError, "input_ids"),
        ("token type out of range", dict(input_ids=ids, token_type_ids=types + 2), ValueError, "token_type_ids"),
        ("mask of another shape", dict(input_ids=ids, attention_mask=mask[:, :-1]), ValueError, "attention_mask"),
        ("float mask", dict(input_ids=ids, attention_mask=mask.float()), TypeError, "attention_mask"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_raises_naming_the_argument(case):
    _, kwargs, error, word = _bad_calls()[case]
    with pytest.raises(error, match=word):
        BertModel(_config())(**kwargs)


def test_bad_labels_raise():
    ids, mask, _ = _batch()
    with pytest.raises(ValueError, match="labels"):
        BertForMaskedLM(_config())(ids, mask, labels=ids[:, :-1])
    with pytest.raises(ValueError, match="labels"):
        BertForSequenceClassification(_config())(ids, mask, labels=torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="config"):
        BertModel(TINY)
