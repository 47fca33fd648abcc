"""Tiny shapes of each family's config, shared by the tests of what a model holds and needs; the GPT fields of
every block variant of issue 49 at once, and a model moved off its start so that each variant's term counts."""

from __future__ import annotations

import torch

GPT_TINY = dict(vocab_size=53, block_size=24, n_layers=3, n_heads=4, d_model=32, d_ff=64)
BERT_TINY = dict(vocab_size=99, max_len=16, n_layers=2, n_heads=2, d_model=8, d_ff=16, n_labels=3)
SEQ2SEQ_TINY = dict(src_vocab_size=40, tgt_vocab_size=40, n_layers=2, d_model=16, n_heads=4, d_ff=32, max_len=12)

# Every block variant of issue 49 on at once (zero_init needs an untied head).
GPT_VARIANTS_49 = dict(activation="relu2", logit_softcap=5.0, zero_init=True, tie_weights=False, embed_norm=True,
                       x0_mix=True, value_residual=True, token_shift=True, bigram_embedding=True)


def moved_off_start(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """`model` with every parameter moved off its start, as training leaves it: zero projections, heads,
    bigram rows, gates and b, λ = 1/2 and a = 1 would each hide a term a test means to exercise."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
            parameter.add_(noise * (0.3 if parameter.ndim <= 1 else 0.05))
    return model


def tiny_hf_bert(directory, *, id2label: dict[int, str] | None = None, seed: int = 0):
    """A random BERT of 1 layer, 16 wide, written by transformers into `directory` with MiniLM's tokenizer files
    (the vocabulary of 30,522 wordpieces): a BertModel, or with `id2label` a BertForSequenceClassification."""
    import shutil

    import transformers

    from plainformer.hf.bert import minilm_path

    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=64,
                                     **({} if id2label is None else {"id2label": id2label}))
    model = (transformers.BertModel(config) if id2label is None
             else transformers.BertForSequenceClassification(config))
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_path() / name, directory / name)
    return directory
