"""Tokenizers: text <-> integer ids, for every model family.

- `CharTokenizer`: one id per character, the vocabulary being the sorted distinct characters of a text
  (nanoGPT's shakespeare-char). A character outside it is an error, never a silent <unk>.
- `BPETokenizer`: byte-level BPE (GPT-2; Sennrich et al. 2016) trained with Hugging Face `tokenizers`.
  Its 256 base symbols are the bytes, so every text encodes and `decode(encode(text)) == text`.
- `WordPieceTokenizer`: BERT's WordPiece (Schuster & Nakajima 2012) — BERT normalisation (optional lowercasing
  with accent stripping), whitespace/punctuation pre-splitting, greedy longest-match-first subwords
  with the "##" continuation prefix, and [CLS] A [SEP] (B [SEP]) framing. Trained with `tokenizers`, or
  loaded from a BERT `vocab.txt` / `tokenizer.json`; gives the ids of `transformers.BertTokenizerFast`.
- `SentencePieceTokenizer`: SentencePiece BPE on raw text, one model for both languages of a translation.
- `MarianTokenizer`: Marian's (opus-mt's) source and target SentencePiece models and the vocab.json that
  gives their pieces ids; gives the ids of `transformers.MarianTokenizer`.

Every tokenizer has `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`, the ids of its
special tokens (`pad_id`, `bos_id`, `eos_id`, `cls_id`, `sep_id`, `mask_id`, `unk_id`; None when it
has no such token) and `save(directory)`, which writes `tokenizer.json` there; `load_tokenizer`
restores any kind. A char tokenizer's `tokenizer.json` is plainformer's own {"kind": "char", ...};
the BPE and WordPiece ones are Hugging Face files (readable by `tokenizers.Tokenizer.from_file`) next
to a small `plainformer_tokenizer.json` naming the kind and the special tokens. Nothing is pickled.
"""

from __future__ import annotations

import abc
import hashlib
import json
import numbers
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import tokenizers as hf
import torch
from torch import Tensor

from .. import _checks
from ..files.atomic import write_files
from ..files.json_file import read_json_object

FORMAT_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"
SIDE_FILE = "plainformer_tokenizer.json"
# The chat template a Hugging Face base came with (jinja2, as transformers renders it), kept beside the
# tokenizer under the name transformers gives it; it changes no id, so no fingerprint reads it.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_ROLES = ("pad", "unk", "cls", "sep", "mask", "bos", "eos")
TRAINING_CHUNK_CHARS = 1 << 16  # small pieces let Hugging Face trainers count words in parallel
BERT_SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


# A cut just after a newline that sits between two non-space characters: whitespace runs cannot
# straddle it, so no pre-tokenizer here (characters, GPT-2's byte-level regex, BERT's whitespace and
# punctuation split) joins text across it, and encoding chunk by chunk equals encoding the whole.
SAFE_CUT = re.compile(r"\S\n(?=\S)")


def text_chunks(text: str, chunk_chars: int, start: int = 0, end: int | None = None) -> Iterator[str]:
    """text[start:end] in pieces of about `chunk_chars` characters, cut only where tokenization is local.

    Concatenating the encodings of the pieces gives the encoding of the whole span, so a big text can
    be encoded (or a tokenizer trained) without a second full copy of it in memory.
    """
    _checks.check_positive_int("chunk_chars", chunk_chars)
    end = len(text) if end is None else end
    while start < end:
        found = SAFE_CUT.search(text, min(start + chunk_chars, end) - 1, end)
        cut = found.end() if found else end
        yield text[start:cut]
        start = cut


def read_tokenizer_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return read_json_object(path, what="a valid JSON tokenizer file")


def _check_text(name: str, text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    return text


def _id_list(ids: object, vocab_size: int) -> list[int]:
    """`ids` (a sequence of ints, or a 1-D integer tensor / array) as a list, each in [0, vocab_size)."""
    if isinstance(ids, (Tensor, np.ndarray)):
        if ids.ndim != 1 or not str(ids.dtype).removeprefix("torch.").startswith(("int", "uint")):
            raise TypeError(f"ids must be a 1-D integer tensor or array, got dtype {ids.dtype} "
                            f"and shape {tuple(ids.shape)}")
        ids = ids.tolist()
    if not isinstance(ids, Sequence) or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool)
                                                for i in ids):
        raise TypeError(f"ids must be a sequence of ints or a 1-D integer tensor, got {type(ids).__name__}")
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"ids must be in [0, {vocab_size}) (vocab_size={vocab_size}), got {bad[0]}")
    return ids


class Tokenizer(abc.ABC):
    """What every tokenizer offers; subclasses set `kind` and implement the abstract methods."""

    kind: ClassVar[str]
    special_tokens: Mapping[str, str]  # role ("pad", "cls", ...) -> token text
    chat_template: str | None = None  # jinja2 text that renders chat messages as a prompt (see CHAT_TEMPLATE_FILE)

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        ...

    @abc.abstractmethod
    def decode(self, ids: Sequence[int] | Tensor) -> str:
        ...

    def encode_text(self, text: str) -> list[int]:
        """The ids of `text` alone, with no special token added around it: what a rendered chat template,
        which writes its own, encodes to (transformers' `add_special_tokens=False`)."""
        return self.encode(text)

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """[encode(t) for t in texts], in parallel where the backend can."""
        return [self.encode(t) for t in texts]

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        ...

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        ...

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary's entry for id i where it differs from decode([i]) (else None)."""
        return None

    @abc.abstractmethod
    def _files(self) -> dict[str, str | bytes]:
        """File name -> content (text, or bytes for a binary model): what `save` writes and `fingerprint` hashes."""
        ...

    @classmethod
    @abc.abstractmethod
    def _from_saved(cls, directory: Path, state: dict[str, Any]) -> Tokenizer:
        """Rebuild from the files `_files` wrote; `state` is the JSON file that names the kind."""
        ...

    def _special_id(self, role: str) -> int | None:
        token = self.special_tokens.get(role)
        return None if token is None else self.token_to_id(token)

    pad_id = property(lambda self: self._special_id("pad"))
    unk_id = property(lambda self: self._special_id("unk"))
    cls_id = property(lambda self: self._special_id("cls"))
    sep_id = property(lambda self: self._special_id("sep"))
    mask_id = property(lambda self: self._special_id("mask"))
    bos_id = property(lambda self: self._special_id("bos"))
    eos_id = property(lambda self: self._special_id("eos"))

    @property
    def all_special_ids(self) -> list[int]:
        # every special token is in the vocabulary, so none of these ids is None
        return sorted(cast(int, self._special_id(role)) for role in self.special_tokens)

    @property
    def fingerprint(self) -> str:
        """sha256 of the saved form: equal fingerprints encode every text identically."""
        digest = hashlib.sha256()
        for name, content in sorted(self._files().items()):
            digest.update(f"{name}\0".encode())
            digest.update(content if isinstance(content, bytes) else content.encode())
            digest.update(b"\0")
        return digest.hexdigest()

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `tokenizer.json` (and the side file and chat template, if any) into `directory`, each
        file atomically."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        files = self._files()
        if self.chat_template is not None:
            files[CHAT_TEMPLATE_FILE] = self.chat_template
        write_files(directory, files)
        return directory

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


class CharTokenizer(Tokenizer):
    """Character-level: id(c) = rank of c among the sorted distinct characters of `text`."""

    kind = "char"
    special_tokens: Mapping[str, str] = {}

    def __init__(self, text: str):
        _check_text("text", text)
        if not text:
            raise ValueError("text must contain at least one character to build a CharTokenizer from")
        self.chars = sorted(set(text))
        self._index = {c: i for i, c in enumerate(self.chars)}
        # Encoding is one table lookup per code point: id, or -1 for a character outside the vocabulary
        # (the table's last entry stands for every code point beyond the largest known one).
        codes = np.array([ord(c) for c in self.chars], dtype=np.int64)
        self._table = np.full(int(codes[-1]) + 2, -1, dtype=np.int32)
        self._table[codes] = np.arange(len(codes), dtype=np.int32)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def token_to_id(self, token: str) -> int | None:
        return self._index.get(token)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """encode(text) as an array (N,) int32, without a Python int per character."""
        _check_text("text", text)
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        ids = self._table[np.minimum(codes, len(self._table) - 1)]
        if ids.min(initial=0) < 0:
            at = int(np.argmax(ids < 0))
            raise ValueError(f"character {text[at]!r} (U+{ord(text[at]):04X}) is not in the tokenizer's "
                             f"vocabulary of {self.vocab_size} characters (first at index {at} of the text)")
        return ids

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        return "".join(self.chars[i] for i in _id_list(ids, self.vocab_size))

    def _files(self) -> dict[str, str | bytes]:
        state = {"kind": self.kind, "format_version": FORMAT_VERSION, "chars": self.chars}
        return {TOKENIZER_FILE: json.dumps(state, ensure_ascii=False, indent=1)}

    @classmethod
    def _from_saved(cls, directory: Path, state: dict[str, Any]) -> CharTokenizer:
        chars = state.get("chars")
        if not isinstance(chars, list) or not chars or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise ValueError(f"{directory / TOKENIZER_FILE}: 'chars' must be a non-empty list of characters")
        return cls("".join(chars))


class _HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers.Tokenizer` plus the roles of its special tokens."""

    def __init__(self, tokenizer: Any, special_tokens: Mapping[str, str]):
        self._tok = tokenizer
        self.special_tokens = dict(special_tokens)
        for role, token in self.special_tokens.items():
            _checks.check_choice("special token role", role, SPECIAL_ROLES)
            if tokenizer.token_to_id(token) is None:
                raise ValueError(f"special token {token!r} ({role}) is not in the vocabulary")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary's entry for id i (a byte-level BPE piece in GPT-2's byte alphabet: "Ġthe")."""
        return self._tok.id_to_token(i)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(_check_text("text", text)).ids

    def encode_text(self, text: str) -> list[int]:
        return self._tok.encode(_check_text("text", text), add_special_tokens=False).ids

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets, which are not needed here.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode([_check_text("texts item", t) for t in texts])]

    def decode(self, ids: Sequence[int] | Tensor, *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(_id_list(ids, self.vocab_size), skip_special_tokens=skip_special_tokens)

    def _files(self) -> dict[str, str | bytes]:
        side = {"kind": self.kind, "format_version": FORMAT_VERSION, "special_tokens": self.special_tokens}
        return {TOKENIZER_FILE: self._tok.to_str(), SIDE_FILE: json.dumps(side, indent=1)}

    @classmethod
    def _from_saved(cls, directory: Path, state: dict[str, Any]) -> _HFTokenizer:
        special = state.get("special_tokens")
        if not isinstance(special, dict):
            raise ValueError(f"{directory / SIDE_FILE}: 'special_tokens' must be an object")
        return cls(hf_from_file(directory / TOKENIZER_FILE), special)


def hf_from_file(path: Path) -> Any:

    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        tok = hf.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{path} is not a valid Hugging Face tokenizer file ({err})") from None
    # Padding and truncation are per call (see WordPieceTokenizer.encode_batch), never file state.
    tok.no_padding()
    tok.no_truncation()
    return tok


def _training_texts(text: str | Iterable[str]) -> Iterator[str]:
    if isinstance(text, str):
        return text_chunks(text, TRAINING_CHUNK_CHARS)
    return (_check_text("text item", piece) for piece in text)


class BPETokenizer(_HFTokenizer):
    """Byte-level BPE: bytes, mapped to printable symbols, merged pairwise by frequency (GPT-2)."""

    kind = "bpe"

    @classmethod
    def train(cls, text: str | Iterable[str], vocab_size: int, *,
              special_tokens: Sequence[str] = ()) -> BPETokenizer:
        """Learn merges on `text` (a string or an iterable of strings) until `vocab_size` tokens.

        vocab_size counts the special tokens (ids 0..k-1, in the order given, written "<role>", e.g.
        special_tokens=("pad", "bos", "eos") -> "<pad>", "<bos>", "<eos>"; that text encodes to the
        special id), the 256 byte symbols and the merges. A text too small to yield that many merges
        gives a smaller vocabulary.
        """
        _checks.check_positive_int("vocab_size", vocab_size)
        roles = list(special_tokens)
        for role in roles:
            _checks.check_choice("special_tokens item", role, SPECIAL_ROLES)
        if len(set(roles)) != len(roles):
            raise ValueError(f"special_tokens must not repeat a role, got {roles}")
        alphabet = hf.pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + len(roles):
            raise ValueError(f"vocab_size must be at least {len(alphabet) + len(roles)} (256 bytes + "
                             f"{len(roles)} special tokens) for byte-level BPE, got {vocab_size}")
        special = {role: f"<{role}>" for role in roles}
        tok = hf.Tokenizer(hf.models.BPE())
        tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = hf.decoders.ByteLevel()
        trainer = hf.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special.values()),
                                         initial_alphabet=alphabet, show_progress=False)
        tok.train_from_iterator(_training_texts(text), trainer=trainer)
        return cls(tok, special)


class WordPieceTokenizer(_HFTokenizer):
    """BERT's tokenizer. `encode(text)` = [CLS] wordpieces [SEP]; pairs add B [SEP] (token type 1)."""

    kind = "wordpiece"

    @staticmethod
    def _pipeline(model: Any, lowercase: bool) -> Any:
        """BERT normalisation and pre-splitting around a WordPiece `model` (framing added later)."""
        tok = hf.Tokenizer(model)
        # strip_accents=None follows lowercase, as in BERT's uncased models.
        tok.normalizer = hf.normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                       strip_accents=None, lowercase=lowercase)
        tok.pre_tokenizer = hf.pre_tokenizers.BertPreTokenizer()
        tok.decoder = hf.decoders.WordPiece(prefix="##")
        return tok

    @classmethod
    def _framed(cls, tok: Any) -> WordPieceTokenizer:
        """Register the special tokens (matched whole in text, skipped by decode) and the framing."""
        missing = [t for t in BERT_SPECIAL_TOKENS.values() if tok.token_to_id(t) is None]
        if missing:
            raise ValueError(f"a BERT WordPiece vocabulary must contain {', '.join(missing)}")
        tok.add_special_tokens(list(BERT_SPECIAL_TOKENS.values()))
        cls_, sep = BERT_SPECIAL_TOKENS["cls"], BERT_SPECIAL_TOKENS["sep"]
        tok.post_processor = hf.processors.TemplateProcessing(
            single=f"{cls_}:0 $A:0 {sep}:0", pair=f"{cls_}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls_, tok.token_to_id(cls_)), (sep, tok.token_to_id(sep))])
        return cls(tok, BERT_SPECIAL_TOKENS)

    @classmethod
    def train(cls, text: str | Iterable[str], vocab_size: int, *, lowercase: bool = True) -> WordPieceTokenizer:
        """Learn a WordPiece vocabulary of `vocab_size` on `text` (a string or an iterable of strings);
        [PAD] [UNK] [CLS] [SEP] [MASK] take ids 0-4."""
        _checks.check_positive_int("vocab_size", vocab_size)
        specials = list(BERT_SPECIAL_TOKENS.values())
        if vocab_size <= len(specials):
            raise ValueError(f"vocab_size must exceed the {len(specials)} special tokens, got {vocab_size}")
        tok = cls._pipeline(hf.models.WordPiece(unk_token=BERT_SPECIAL_TOKENS["unk"]), lowercase)
        trainer = hf.trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials,
                                               show_progress=False)
        tok.train_from_iterator(_training_texts(text), trainer=trainer)
        return cls._framed(tok)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, lowercase: bool | None = None) -> WordPieceTokenizer:
        """Load a Hugging Face BERT tokenizer: a directory (its tokenizer.json, else its vocab.txt),
        or the path of a tokenizer.json or vocab.txt file.

        lowercase applies to a vocab.txt only (a tokenizer.json carries its own normaliser); None reads
        `do_lower_case` from a tokenizer_config.json beside it, else lowercases (BERT uncased).
        """
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE if (path / TOKENIZER_FILE).is_file() else path / "vocab.txt"
        if not path.is_file():
            raise FileNotFoundError(f"no BERT tokenizer at {path} (expected a tokenizer.json or vocab.txt)")
        if path.suffix == ".json":
            if lowercase is not None:
                raise ValueError("lowercase cannot be set when loading a tokenizer.json: "
                                 "its normaliser already decides")
            return cls(hf_from_file(path), BERT_SPECIAL_TOKENS)
        if lowercase is None:
            config = path.parent / "tokenizer_config.json"
            lowercase = bool(read_tokenizer_json(config).get("do_lower_case", True)) if config.is_file() else True
        model = hf.models.WordPiece.from_file(str(path), unk_token=BERT_SPECIAL_TOKENS["unk"],
                                              max_input_chars_per_word=100)
        return cls._framed(cls._pipeline(model, lowercase))

    def encode(self, text: str, pair: str | None = None) -> list[int]:
        _check_text("text", text)
        if pair is not None:
            _check_text("pair", pair)
        return self._tok.encode(text, pair).ids

    def encode_batch(self, texts: Sequence[str], max_length: int | None = None,
                     pairs: Sequence[str] | None = None) -> dict[str, Tensor]:
        """Encode and right-pad a batch to its longest member (after truncation to max_length).

        Returns input_ids (B, n) long, attention_mask (B, n) bool (True = real token, may be attended)
        and token_type_ids (B, n) long (0 for [CLS] A [SEP], 1 for B [SEP]). Pairs are truncated
        longest-first, as in Hugging Face.
        """
        encodings = self._encodings(texts, max_length, pairs, pad=True)
        return {
            "input_ids": torch.tensor([e.ids for e in encodings], dtype=torch.long),
            "attention_mask": torch.tensor([e.attention_mask for e in encodings], dtype=torch.bool),
            "token_type_ids": torch.tensor([e.type_ids for e in encodings], dtype=torch.long),
        }

    def encode_each(self, texts: Sequence[str], max_length: int | None = None,
                    pairs: Sequence[str] | None = None) -> list[tuple[list[int], list[int]]]:
        """Each text (with its pair) as (ids, token type ids), unpadded, truncated as `encode_batch` truncates:
        what a caller that batches by length encodes once."""
        return [(e.ids, e.type_ids) for e in self._encodings(texts, max_length, pairs, pad=False)]

    def _encodings(self, texts: Sequence[str], max_length: int | None, pairs: Sequence[str] | None,
                   *, pad: bool) -> list[Any]:
        if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
            raise TypeError(f"texts must be a non-empty list of str, got {type(texts).__name__}")
        items: list[Any] = [_check_text("texts item", t) for t in texts]
        if pairs is not None:
            if isinstance(pairs, str) or not isinstance(pairs, Sequence) or len(pairs) != len(texts):
                raise ValueError(f"pairs must be a list of str as long as texts ({len(texts)})")
            items = [(a, _check_text("pairs item", b)) for a, b in zip(items, pairs, strict=True)]
        if max_length is not None:
            _checks.check_positive_int("max_length", max_length)
            framing = self._tok.num_special_tokens_to_add(pairs is not None)
            if max_length <= framing + (pairs is not None):
                raise ValueError(f"max_length must leave room for the {framing} special tokens and at least "
                                 f"one token per sequence, got {max_length}")
        try:
            if max_length is not None:
                self._tok.enable_truncation(max_length, strategy="longest_first")
            if pad:
                self._tok.enable_padding(pad_id=self.pad_id, pad_token=self.special_tokens["pad"])
            return self._tok.encode_batch(items)
        finally:
            self._tok.no_truncation()
            self._tok.no_padding()


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece (Kudo & Richardson 2018): subwords learnt by BPE (Sennrich et al. 2016) on raw text, a
    space written as "▁" inside the pieces, so that `decode(encode(text))` gives the text back (NFKC-normalised)
    without a detokenizer. Translation uses one model learnt on both languages (the paper's shared vocabulary);
    it is the tokenizer of Marian and opus-mt, which transformers' MarianTokenizer and CTranslate2 read.

    Ids: <pad> 0, <unk> 1, <s> 2 (bos), </s> 3 (eos), then the pieces. Saved as the model's own bytes
    (`sentencepiece.model`) beside a tokenizer.json naming the kind.
    """

    kind = "sentencepiece"
    MODEL_FILE = "sentencepiece.model"
    special_tokens: Mapping[str, str] = {"pad": "<pad>", "unk": "<unk>", "bos": "<s>", "eos": "</s>"}

    def __init__(self, model: bytes):
        import sentencepiece as spm

        self._model = bytes(model)
        self._sp = spm.SentencePieceProcessor(model_proto=self._model)
        for role, token in self.special_tokens.items():
            if self._sp.piece_to_id(token) != getattr(self._sp, f"{role}_id")():
                raise ValueError(f"the SentencePiece model's {role} piece is not {token!r}")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, *, max_sentences: int = 2_000_000,
              threads: int = 2) -> SentencePieceTokenizer:
        """Learn a BPE model of `vocab_size` pieces (specials included) on `texts`, streamed: SentencePiece
        keeps a random sample of at most `max_sentences` of them (its input_sentence_size)."""
        import io

        import sentencepiece as spm

        _checks.check_positive_int("vocab_size", vocab_size)
        _checks.check_positive_int("max_sentences", max_sentences)
        model = io.BytesIO()
        raised: list[BaseException] = []  # what reading `texts` raised: SentencePiece would bury it in its own error

        def sentences() -> Iterator[str]:
            try:
                for text in texts:
                    yield _check_text("texts item", text)
            except Exception as error:
                raised.append(error)

        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences(), model_writer=model,
                vocab_size=vocab_size, model_type="bpe", character_coverage=1.0,
                input_sentence_size=max_sentences, shuffle_input_sentence=True, num_threads=threads,
                pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece="<pad>", unk_piece="<unk>",
                bos_piece="<s>", eos_piece="</s>", minloglevel=2)
        except RuntimeError as error:  # e.g. "Vocabulary size is too high (8000). Please set it to a value <= 5012."
            if raised:
                raise raised[0] from None
            raise ValueError(f"SentencePiece could not learn a vocabulary of {vocab_size} pieces: {error}") from None
        if raised:
            raise raised[0]
        return cls(model.getvalue())

    @property
    def model_bytes(self) -> bytes:
        """The SentencePiece model, serialized: what `sentencepiece.model` holds (and a Marian source.spm)."""
        return self._model

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != "<unk>" else i

    def id_to_token(self, i: int) -> str | None:
        return self._sp.id_to_piece(i)

    def pieces(self, text: str) -> list[str]:
        """The pieces of `text` as strings ("▁A", "▁man", ...): what CTranslate2 takes."""
        return self._sp.encode(_check_text("text", text), out_type=str)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(_check_text("text", text))

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode([_check_text("texts item", t) for t in texts])

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        return self._sp.decode(_id_list(ids, self.vocab_size))  # control pieces (<pad>, <s>, </s>) decode to ""

    def _files(self) -> dict[str, str | bytes]:
        state = {"kind": self.kind, "format_version": FORMAT_VERSION, "model": self.MODEL_FILE}
        return {TOKENIZER_FILE: json.dumps(state, indent=1), self.MODEL_FILE: self._model}

    @classmethod
    def _from_saved(cls, directory: Path, state: dict[str, Any]) -> SentencePieceTokenizer:
        path = directory / cls.MODEL_FILE
        if not path.is_file():
            raise FileNotFoundError(f"SentencePiece model not found: {path}")
        try:
            return cls(path.read_bytes())
        except RuntimeError as error:
            raise ValueError(f"{path} is not a SentencePiece model ({error})") from None


class MarianTokenizer(Tokenizer):
    """Marian's tokenizer (Helsinki-NLP's opus-mt models), as transformers' MarianTokenizer reads a model
    directory: a source SentencePiece model cuts the text into pieces, vocab.json gives each piece its id (not
    the SentencePiece id; a piece it lacks is <unk>), and a target SentencePiece model joins the pieces of an
    output back into text. One vocabulary serves both sides; a leading language code ">>fr<<" (a multilingual
    model's target) is one token. Decoding leaves out the special tokens, as transformers'
    `decode(skip_special_tokens=True)` does. There is no <s>: Marian's decoder starts from <pad>.

    Saved as the three files of a Marian directory (source.spm, target.spm, vocab.json) beside a
    tokenizer.json naming the kind.
    """

    kind = "marian"
    SOURCE_FILE, TARGET_FILE, VOCAB_FILE = "source.spm", "target.spm", "vocab.json"
    special_tokens: Mapping[str, str] = {"pad": "<pad>", "unk": "<unk>", "eos": "</s>"}

    def __init__(self, source: bytes, target: bytes, vocab: Mapping[str, int]):
        import sentencepiece as spm

        ids = sorted(vocab.values()) if all(_checks.is_int(i) for i in vocab.values()) else None
        if ids != list(range(len(vocab))):
            raise ValueError(f"vocab must give its {len(vocab)} pieces the ids 0 .. {len(vocab) - 1}, each once")
        missing = [token for token in self.special_tokens.values() if token not in vocab]
        if missing:
            raise ValueError(f"vocab lacks the special token(s) {', '.join(missing)}")
        self._source, self._target, self.vocab = bytes(source), bytes(target), dict(vocab)
        self._pieces = sorted(self.vocab, key=self.vocab.__getitem__)  # id -> piece
        self._sp_source = spm.SentencePieceProcessor(model_proto=self._source)
        self._sp_target = spm.SentencePieceProcessor(model_proto=self._target)
        self._unk = self.vocab["<unk>"]
        self._skipped = {self.vocab[token] for token in self.special_tokens.values()}

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> MarianTokenizer:
        """The tokenizer of a Marian directory (source.spm, target.spm, vocab.json), as transformers'
        MarianTokenizer.from_pretrained reads it; one with a target vocabulary of its own is refused."""
        directory = Path(directory)
        config = directory / "tokenizer_config.json"
        if config.is_file() and read_tokenizer_json(config).get("separate_vocabs"):
            raise ValueError(f"{config}: separate_vocabs (a target vocabulary of its own, target_vocab.json) is not "
                             "supported: plainformer reads one vocabulary shared by both sides")
        for name in (cls.SOURCE_FILE, cls.TARGET_FILE):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory} lacks {name}, a file of Marian's tokenizer")
        return cls._from_saved(directory, {})

    @property
    def source_model(self) -> bytes:
        """source.spm, serialized."""
        return self._source

    @property
    def target_model(self) -> bytes:
        """target.spm, serialized."""
        return self._target

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def id_to_token(self, i: int) -> str | None:
        return self._pieces[i]

    @staticmethod
    def _language_code(text: str) -> tuple[list[str], str]:
        """A leading ">>xx<<" as a token of its own, and the text after it."""
        end = text.find("<<") if text.startswith(">>") else -1
        return ([text[:end + 2]], text[end + 2:]) if end != -1 else ([], text)

    def encode(self, text: str) -> list[int]:
        return [self.vocab.get(piece, self._unk) for piece in self.pieces(text)]

    def pieces(self, text: str) -> list[str]:
        """The pieces of `text` as strings, a language code first: what CTranslate2 takes."""
        code, rest = self._language_code(_check_text("text", text))
        return code + self._sp_source.encode(rest, out_type=str)

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        pieces = [self._pieces[i] for i in _id_list(ids, self.vocab_size) if i not in self._skipped]
        return self._sp_target.decode_pieces(pieces).replace("▁", " ").strip()

    def _files(self) -> dict[str, str | bytes]:
        state = {"kind": self.kind, "format_version": FORMAT_VERSION}
        return {TOKENIZER_FILE: json.dumps(state, indent=1), self.SOURCE_FILE: self._source,
                self.TARGET_FILE: self._target, self.VOCAB_FILE: json.dumps(self.vocab, ensure_ascii=False, indent=1)}

    @classmethod
    def _from_saved(cls, directory: Path, state: dict[str, Any]) -> MarianTokenizer:
        vocab = read_json_object(directory / cls.VOCAB_FILE, what="Marian's vocabulary (JSON: piece -> id)")
        try:
            return cls((directory / cls.SOURCE_FILE).read_bytes(), (directory / cls.TARGET_FILE).read_bytes(), vocab)
        except RuntimeError as error:
            raise ValueError(f"{directory}: {cls.SOURCE_FILE} or {cls.TARGET_FILE} is not a SentencePiece model "
                             f"({error})") from None


_KINDS: dict[str, type[Tokenizer]] = {
    t.kind: t for t in (CharTokenizer, BPETokenizer, WordPieceTokenizer, SentencePieceTokenizer, MarianTokenizer)}


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Restore a tokenizer written by `save(directory)`, whatever its kind."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {directory}")
    side = directory / SIDE_FILE
    state = read_tokenizer_json(side if side.is_file() else directory / TOKENIZER_FILE)
    kind = state.get("kind")
    if kind not in _KINDS:
        hint = (" (a Hugging Face BERT tokenizer loads with WordPieceTokenizer.from_pretrained)"
                if kind is None else "")
        raise ValueError(f"{directory} does not hold a plainformer tokenizer: kind is {kind!r}, expected "
                         f"one of {', '.join(map(repr, _KINDS))}{hint}")
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory}: tokenizer format_version {state.get('format_version')!r} is not "
                         f"supported (expected {FORMAT_VERSION})")
    tokenizer = _KINDS[kind]._from_saved(directory, state)
    tokenizer.chat_template = read_chat_template(directory)
    return tokenizer


def read_chat_template(directory: Path) -> str | None:
    """The text of `directory`'s chat_template.jinja, if it has one."""
    path = directory / CHAT_TEMPLATE_FILE
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
