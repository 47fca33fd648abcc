"""Marian directories in Helsinki-NLP's opus-mt layout, built here with random weights and transformers' own
classes: MarianMTModel with swish, a final_logits_bias, <pad> (last id, zero embedding) as the decoder's start,
</s> 0 and <unk> 1; two SentencePiece models (source.spm, target.spm, unigram as opus-mt's) trained locally on a
few hundred lines, and one vocab.json whose ids are not theirs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import sentencepiece as spm
import torch

import plainformer as pf


def corpus_lines(start: int, count: int) -> list[str]:
    """`count` non-empty lines of the bundled corpus from the `start`-th on."""
    lines = [line.strip() for line in pf.load_text().splitlines() if line.strip()]
    return lines[start:start + count]


def train_spm(lines: list[str], vocab_size: int) -> bytes:
    """A unigram SentencePiece model as opus-mt's, trained on `lines`: <unk> 0, <s> 1, </s> 2, no <pad>."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=1.0, minloglevel=2)
    return model.getvalue()


def marian_vocab(source: bytes, target: bytes) -> dict[str, int]:
    """Marian's joint vocabulary of two SentencePiece models: </s> 0, <unk> 1, then the source's pieces and the
    target's new ones in their order, <pad> last."""
    vocab = {"</s>": 0, "<unk>": 1}
    for model in (source, target):
        processor = spm.SentencePieceProcessor(model_proto=model)
        for i in range(processor.get_piece_size()):
            if not (processor.is_control(i) or processor.is_unknown(i)):
                vocab.setdefault(processor.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    return vocab


def write_opus_mt_tokenizer(directory: Path, source_lines: list[str], target_lines: list[str],
                            vocab_size: int = 120) -> dict[str, int]:
    """source.spm, target.spm, vocab.json and tokenizer_config.json of an opus-mt directory; its vocab."""
    directory.mkdir(parents=True, exist_ok=True)
    source, target = train_spm(source_lines, vocab_size), train_spm(target_lines, vocab_size)
    vocab = marian_vocab(source, target)
    (directory / "source.spm").write_bytes(source)
    (directory / "target.spm").write_bytes(target)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "MarianTokenizer", "source_lang": "en", "target_lang": "xx", "separate_vocabs": False,
         "model_max_length": 64}))
    return vocab


def opus_mt_model(vocab_size: int, seed: int = 0, **changes):
    """A MarianMTModel of opus-mt's layout and random weights, moved off transformers' small start (init_std
    0.02 leaves logits all but tied) with LayerNorms and a final_logits_bias of their own; pad's row zero."""
    from transformers import MarianConfig, MarianMTModel

    pad = vocab_size - 1
    options = dict(vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=16, encoder_layers=2,
                   decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                   decoder_ffn_dim=32, max_position_embeddings=64, activation_function="swish", scale_embedding=True,
                   share_encoder_decoder_embeddings=True, tie_word_embeddings=True, pad_token_id=pad, eos_token_id=0,
                   decoder_start_token_id=pad, forced_eos_token_id=0, init_std=0.3, dropout=0.1)
    torch.manual_seed(seed)
    model = MarianMTModel(MarianConfig(**{**options, **changes}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layer_norm" in name:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
        model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=generator))
        model.get_decoder().embed_tokens.weight[pad] = 0.0
    return model.eval()


def opus_mt_directory(directory: Path, seed: int = 0, **changes) -> Path:
    """A whole opus-mt style directory: the tokenizer's files and a random model's (see `opus_mt_model`)."""
    vocab = write_opus_mt_tokenizer(directory, corpus_lines(0, 300), [line.upper() for line in corpus_lines(300, 300)])
    opus_mt_model(len(vocab), seed, **changes).save_pretrained(directory)
    return directory
