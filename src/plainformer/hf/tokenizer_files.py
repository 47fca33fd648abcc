"""Hugging Face tokenizer files: any plainformer tokenizer as tokenizer.json + tokenizer_config.json that
`transformers.AutoTokenizer` loads, and the tokenizer of a Hugging Face directory (its tokenizer.json, or
GPT-2's original vocab.json + merges.txt) as ours."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import tokenizers as hf

from .. import _checks
from ..data.tokenizers import (
    BERT_SPECIAL_TOKENS,
    FORMAT_VERSION,
    SIDE_FILE,
    SPECIAL_ROLES,
    TOKENIZER_FILE,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    WordPieceTokenizer,
    hf_from_file,
    load_tokenizer,
    read_chat_template,
    read_tokenizer_json,
)
from ..files.atomic import atomic_path

HF_TOKENIZER_CONFIG = "tokenizer_config.json"
# GPT-2's original tokenizer files (its "slow" tokenizer), which older directories hold instead of a
# tokenizer.json, and the special tokens transformers' GPT2Tokenizer gives them unless the config says.
GPT2_VOCAB, GPT2_MERGES = "vocab.json", "merges.txt"
_GPT2_SPECIAL_TOKENS = {"unk": "<|endoftext|>", "bos": "<|endoftext|>", "eos": "<|endoftext|>"}
_CHAR_UNKNOWN = "<unk>"  # absent from the vocabulary on purpose: an unknown character is an error there too


def _char_as_hf(tokenizer: CharTokenizer) -> Any:
    """A `tokenizers.Tokenizer` giving a char tokenizer's ids: each character is a word, looked up whole."""
    tok = hf.Tokenizer(hf.models.WordLevel({c: i for i, c in enumerate(tokenizer.chars)},
                                           unk_token=_CHAR_UNKNOWN))
    tok.pre_tokenizer = hf.pre_tokenizers.Split(hf.Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = hf.decoders.Fuse()
    return tok


def save_hf_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike, *,
                      model_max_length: int | None = None) -> Path:
    """Write `tokenizer` as Hugging Face tokenizer.json + tokenizer_config.json, which
    `transformers.AutoTokenizer.from_pretrained(directory)` loads as a fast tokenizer giving the same ids
    (`encode(text, add_special_tokens=True)`) and texts; plainformer's side file rides along, so
    `load_tokenizer` and `load_hf_tokenizer` restore the original."""
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a plainformer Tokenizer, got {type(tokenizer).__name__}")
    if model_max_length is not None:
        _checks.check_positive_int("model_max_length", model_max_length)
    if isinstance(tokenizer, CharTokenizer):
        backend = _char_as_hf(tokenizer)
        side = {"kind": tokenizer.kind, "format_version": FORMAT_VERSION, "chars": tokenizer.chars}
        files = {TOKENIZER_FILE: backend.to_str(), SIDE_FILE: json.dumps(side, ensure_ascii=False, indent=1)}
    else:
        files = tokenizer._files()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              **{f"{role}_token": token for role, token in tokenizer.special_tokens.items()}}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    files[HF_TOKENIZER_CONFIG] = json.dumps(config, ensure_ascii=False, indent=1, sort_keys=True)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        with atomic_path(directory / name) as tmp:
            tmp.write_text(content, encoding="utf-8")
    return directory


def _hf_special_tokens(directory: Path) -> dict[str, str]:
    """Role -> token text, from the `<role>_token` entries of a tokenizer_config.json (if any)."""
    path = directory / HF_TOKENIZER_CONFIG
    config = read_tokenizer_json(path) if path.is_file() else {}
    special = {}
    for role in SPECIAL_ROLES:
        token = config.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            special[role] = token
    return special


def has_gpt2_files(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds GPT-2's vocab.json and merges.txt."""
    return all((Path(directory) / name).is_file() for name in (GPT2_VOCAB, GPT2_MERGES))


def _gpt2_from_files(directory: Path) -> BPETokenizer:
    """vocab.json + merges.txt as the pipeline transformers' GPT2Tokenizer builds from them: byte-level
    BPE behind GPT-2's pre-tokenizer regex, byte-level decoding, the special tokens (tokenizer_config.json's,
    else <|endoftext|> as unk, bos and eos) matched whole in the text and appended to the vocabulary where
    vocab.json lacks them, and tokenizer_config.json's add_prefix_space, add_bos_token and add_eos_token
    (each false unless it says)."""
    path = directory / HF_TOKENIZER_CONFIG
    config = read_tokenizer_json(path) if path.is_file() else {}
    try:
        model = hf.models.BPE.from_file(str(directory / GPT2_VOCAB), str(directory / GPT2_MERGES))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{directory}: {GPT2_VOCAB} and {GPT2_MERGES} are not a valid BPE vocabulary "
                         f"and merge list ({err})") from None
    tok = hf.Tokenizer(model)
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space", False)))
    tok.decoder = hf.decoders.ByteLevel()
    special = {**_GPT2_SPECIAL_TOKENS, **_hf_special_tokens(directory)}
    tok.add_special_tokens([hf.AddedToken(token, special=True) for token in dict.fromkeys(special.values())])
    bos = [special["bos"]] if config.get("add_bos_token") else []
    eos = [special["eos"]] if config.get("add_eos_token") else []
    if bos or eos:  # <bos> text <eos>, as GPT2Tokenizer frames it
        tok.post_processor = hf.processors.TemplateProcessing(
            single=" ".join([*bos, "$A", *eos]), special_tokens=[(t, tok.token_to_id(t)) for t in {*bos, *eos}])
    return BPETokenizer(tok, special)


def _hf_chat_template(directory: Path) -> str | None:
    """The directory's chat template: chat_template.jinja, else tokenizer_config.json's `chat_template`
    (a string, or a list of {"name", "template"} of which "default" is the one transformers applies)."""
    template = read_chat_template(directory)
    path = directory / HF_TOKENIZER_CONFIG
    if template is not None or not path.is_file():
        return template
    value = read_tokenizer_json(path).get("chat_template")
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def load_hf_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a Hugging Face directory as ours, with its chat template: `_hf_tokenizer`."""
    directory = Path(directory)
    tokenizer = _hf_tokenizer(directory)
    tokenizer.chat_template = _hf_chat_template(directory)
    return tokenizer


def _hf_tokenizer(directory: Path) -> Tokenizer:
    """plainformer's own tokenizer when its side file is there, else the tokenizer.json's model —
    byte-level BPE (any BPE) as `BPETokenizer`, WordPiece as `WordPieceTokenizer`, a one-character-per-token
    WordLevel as `CharTokenizer` — with the special tokens tokenizer_config.json names; without a
    tokenizer.json, GPT-2's vocab.json + merges.txt as `BPETokenizer`."""
    if (directory / SIDE_FILE).is_file():
        return load_tokenizer(directory)
    if not (directory / TOKENIZER_FILE).is_file() and has_gpt2_files(directory):
        return _gpt2_from_files(directory)
    path = directory / TOKENIZER_FILE
    model = read_tokenizer_json(path).get("model") or {}
    kind = model.get("type")
    tok = hf_from_file(path)
    present = {role: t for role, t in _hf_special_tokens(directory).items() if tok.token_to_id(t) is not None}
    if kind == "BPE":
        return BPETokenizer(tok, present)
    if kind == "WordPiece":
        return WordPieceTokenizer(tok, present or BERT_SPECIAL_TOKENS)
    vocab = tok.get_vocab(with_added_tokens=True)
    chars = sorted(vocab)
    if kind == "WordLevel" and all(len(c) == 1 for c in chars) and [vocab[c] for c in chars] == list(range(len(chars))):
        return CharTokenizer("".join(chars))
    raise ValueError(f"{path}: a {kind!r} tokenizer model does not load as a plainformer tokenizer "
                     "(expected BPE, WordPiece, or a WordLevel of single characters in sorted order)")
