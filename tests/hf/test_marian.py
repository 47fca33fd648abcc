"""Marian directories, proven by the programs that read them. Out: a translation run trained briefly on Multi30k
and exported (`plainformer export`) loads in transformers, whose greedy output equals ours token for token on
test2016 and whose logits agree within 1e-4, and CTranslate2's own converter converts it, its greedy output
equal to ours on at least 99% of test2016. In: a directory in Helsinki-NLP's opus-mt layout, built with
transformers' classes and random weights, translates here as transformers translates it."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from plainformer.cli import main
from plainformer.data.tokenizers import BPETokenizer, MarianTokenizer
from plainformer.hf.auto import load_hf, save_hf
from plainformer.hf.marian import load_marian, marian_order, marian_table, save_marian
from plainformer.models.transformer import EXTRA_OUTPUT_TOKENS, Transformer, TransformerConfig
from tests.reference.marian import corpus_lines, opus_mt_directory, opus_mt_model
from tests.reference.shared_data import shared_data
from tests.reference.tiny_models import moved_off_start

transformers = pytest.importorskip("transformers")

LOGITS_TOLERANCE = 1e-4  # the bound, fp32 through two implementations of the same network
CT2_AGREEMENT = 0.99  # greedy outputs of CTranslate2 equal to ours, at least (1000 of 1000 when written)
# A run that learns in seconds: its translations are poor but depend on the source (some run to the length
# limit, which the comparison then covers too).
TINY_RUN = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--d-ff", "64", "--vocab-size", "500",
            "--batch-tokens", "1024", "--max-steps", "250", "--warmup-steps", "100", "--eval-interval", "250",
            "--keep-checkpoints", "1"]


def _quiet(*argv: str) -> tuple[int, str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        status = main(list(argv))
    return status, stdout.getvalue()


@pytest.fixture(scope="module")
def multi30k() -> Path:
    return shared_data("multi30k")


@pytest.fixture(scope="module")
def run(multi30k, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("multi30k") / "run"
    status, _ = _quiet("train", "--preset", "multi30k-de-en", "--data", str(multi30k / "train"), "--val-data",
                       str(multi30k / "val"), *TINY_RUN, "--out", str(out), "--no-progress")
    assert status == 0
    return out


@pytest.fixture(scope="module")
def model(run) -> Transformer:
    return Transformer.from_checkpoint(run / "best")


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "marian"
    status, stdout = _quiet("export", "--ckpt", str(run), "--out", str(out))
    assert status == 0 and json.loads(stdout)["architecture"] == "MarianMTModel"
    return out


@pytest.fixture(scope="module")
def test2016(multi30k) -> list[str]:
    with gzip.open(multi30k / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as lines:
        return [line.rstrip("\n") for line in lines]


def _sources(model: Transformer, texts: list[str]) -> list[list[int]]:
    """Our source ids, </s> ended (Marian's and our translation runs' convention)."""
    return [ids + [model.config.eos_id] for ids in model.tokenizer.encode_many(texts)]


def _limit(model: Transformer, source: list[int]) -> int:
    """The output tokens ours allows a source: its length + 50, at most max_len."""
    return min(len(source) + EXTRA_OUTPUT_TOKENS, model.config.max_len)


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos)] if eos in tokens else tokens


@pytest.fixture(scope="module")
def ours_greedy(model, test2016) -> list[list[int]]:
    """Our greedy output of each test2016 source (our ids, </s> and what follows dropped)."""
    sources = _sources(model, test2016)
    outputs: list[list[int]] = [[] for _ in sources]
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    for start in range(0, len(order), 100):
        chunk = order[start:start + 100]
        src = pad_sequence([torch.tensor(sources[i]) for i in chunk], batch_first=True,
                           padding_value=model.config.pad_id)
        for i, row in zip(chunk, model.generate(src).tolist(), strict=True):
            outputs[i] = _until_eos(row[1:], model.config.eos_id)
    return outputs


def _by_length(sources: list[list]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, source in enumerate(sources):
        groups.setdefault(len(source), []).append(i)
    return groups


def _marian_ids(model: Transformer) -> torch.Tensor:
    """Our id -> the export's (Marian's) id."""
    return torch.argsort(marian_order(model.config))


# ----------------------------------------------------------------------------- export: transformers

def test_the_export_is_a_marian_directory_with_pad_last_and_our_pieces(model, exported):
    config = json.loads((exported / "config.json").read_text())
    vocab = json.loads((exported / "vocab.json").read_text())
    size = model.config.tgt_vocab_size
    assert config["pad_token_id"] == config["decoder_start_token_id"] == vocab["<pad>"] == size - 1
    assert config["eos_token_id"] == vocab["</s>"] and config["scale_embedding"] and config["tie_word_embeddings"]
    assert (exported / "source.spm").read_bytes() == (exported / "target.spm").read_bytes()
    marian = _marian_ids(model)
    assert {piece: int(marian[model.tokenizer.token_to_id(piece)]) for piece in vocab} == vocab


def test_transformers_marian_tokenizer_gives_our_source_ids(model, exported, test2016):
    tokenizer = transformers.MarianTokenizer.from_pretrained(exported)
    marian = _marian_ids(model)
    ours = [marian[torch.tensor(ids)].tolist() for ids in _sources(model, test2016)]
    assert tokenizer(test2016)["input_ids"] == ours


def test_transformers_greedy_output_equals_ours_token_for_token_on_test2016(model, exported, test2016, ours_greedy):
    hf = transformers.MarianMTModel.from_pretrained(exported).eval()
    marian = _marian_ids(model)
    sources = [marian[torch.tensor(ids)] for ids in _sources(model, test2016)]
    eos = int(marian[model.config.eos_id])
    theirs: list[list[int]] = [[] for _ in sources]
    with torch.no_grad():
        for length, members in _by_length(sources).items():
            out = hf.generate(input_ids=torch.stack([sources[i] for i in members]), num_beams=1, do_sample=False,
                              max_new_tokens=min(length + EXTRA_OUTPUT_TOKENS, model.config.max_len))
            for i, row in zip(members, out.tolist(), strict=True):
                theirs[i] = _until_eos(row[1:], eos)  # the decoder's start, pad, first
    ours = [marian[torch.tensor(tokens, dtype=torch.long)].tolist() for tokens in ours_greedy]
    differing = [i for i in range(len(ours)) if ours[i] != theirs[i]]
    assert not differing, f"{len(differing)} of {len(ours)} differ, first test2016 line {differing[0] + 1}"
    assert len({tuple(tokens) for tokens in ours}) > 100  # outputs that depend on the source (318 when written)


def test_transformers_logits_agree_within_1e_4(model, exported, test2016, ours_greedy):
    """Teacher-forced on our greedy outputs of 200 sentences; pad's column is the bias alone in the export
    (its row is the zero vector Marian starts from), 0 here."""
    hf = transformers.MarianMTModel.from_pretrained(exported).eval()
    marian = _marian_ids(model)
    sources = _sources(model, test2016[:200])
    src = pad_sequence([torch.tensor(ids) for ids in sources], batch_first=True, padding_value=model.config.pad_id)
    tgt = pad_sequence([torch.tensor([model.config.bos_id, *tokens]) for tokens in ours_greedy[:200]],
                       batch_first=True, padding_value=model.config.pad_id)
    real = torch.cat((torch.ones(len(sources), 1, dtype=torch.bool), tgt[:, 1:] != model.config.pad_id), dim=1)
    with torch.no_grad():
        ours = model(src, tgt)[0][..., marian_order(model.config)]
        hf_tgt = marian[tgt]
        hf_tgt[:, 0] = hf.config.decoder_start_token_id
        theirs = hf(input_ids=marian[src], attention_mask=src != model.config.pad_id, decoder_input_ids=hf_tgt).logits
    error = (ours[real][:, :-1] - theirs[real][:, :-1]).abs().max().item()
    assert error <= LOGITS_TOLERANCE, f"max |logit difference| {error:.3g}"
    assert torch.equal(theirs[real][:, -1], torch.zeros(int(real.sum())))


# ----------------------------------------------------------------------------- export: CTranslate2

def test_ctranslate2_converts_the_export_and_its_greedy_output_equals_ours(model, exported, test2016, ours_greedy,
                                                                           tmp_path):
    """ct2-transformers-converter (a process, as a user runs it); ctranslate2 appends nothing to a Marian
    model's source (its config.json: add_source_eos false), so the pieces end with </s> as ours do."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    converter = Path(sys.executable).parent / "ct2-transformers-converter"
    if not converter.is_file():
        pytest.skip(f"{converter} is absent: CTranslate2's converter comes with `pip install ctranslate2`")
    out = tmp_path / "ct2"
    subprocess.run([str(converter), "--model", str(exported), "--output_dir", str(out)], check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert json.loads((out / "config.json").read_text())["add_source_eos"] is False
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="float32", intra_threads=1)
    pieces = [model.tokenizer.pieces(text) + ["</s>"] for text in test2016]
    theirs: list[list[str]] = [[] for _ in pieces]
    for length, members in _by_length(pieces).items():
        results = translator.translate_batch([pieces[i] for i in members], beam_size=1,
                                             max_decoding_length=min(length + EXTRA_OUTPUT_TOKENS,
                                                                     model.config.max_len))
        for i, result in zip(members, results, strict=True):
            theirs[i] = result.hypotheses[0]
    ours = [[model.tokenizer.id_to_token(t) for t in tokens] for tokens in ours_greedy]
    equal = sum(a == b for a, b in zip(ours, theirs, strict=True))
    agreement = equal / len(ours)
    print(f"CTranslate2 fp32 greedy = ours on {equal} of {len(ours)} test2016 sentences")
    assert agreement >= CT2_AGREEMENT, f"CTranslate2's greedy output equals ours on {agreement:.1%} of test2016"


# ----------------------------------------------------------------------------- export, read back

def test_the_export_reads_back_as_the_model_it_was(model, exported, test2016):
    """The start folded into the decoder's position 0 is found again as <s>, whose embedding it is."""
    back = load_hf(exported)
    assert isinstance(back, Transformer) and isinstance(back.tokenizer, MarianTokenizer)
    marian = _marian_ids(model)
    assert back.config.bos_id == marian[model.config.bos_id] and back.config.pad_id == marian[model.config.pad_id]
    assert back.translate(test2016[:50]) == model.translate(test2016[:50])
    src = pad_sequence([torch.tensor(ids) for ids in _sources(model, test2016[:8])], batch_first=True,
                       padding_value=model.config.pad_id)
    real = torch.tensor([i for i in range(model.config.tgt_vocab_size) if i != model.config.pad_id])
    tgt = real[torch.randint(0, len(real), (8, 10), generator=torch.Generator().manual_seed(0))]
    tgt[:, 0] = model.config.bos_id
    with torch.no_grad():
        ours = model(src, tgt)[0][..., marian_order(model.config)]
        theirs = back(marian[src], marian[tgt])[0]
    assert (ours[..., :-1] - theirs[..., :-1]).abs().max() <= LOGITS_TOLERANCE


def test_translate_and_eval_take_the_export_as_ckpt(run, model, exported, test2016, multi30k, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(test2016[:5]).encode())))
    status, stdout = _quiet("translate", "--ckpt", str(exported), "--beam", "1")
    assert status == 0 and stdout.splitlines() == model.translate(test2016[:5])
    args = ["--data", str(multi30k / "test_2016_flickr"), "--source-lang", "de", "--target-lang", "en", "--beam", "1"]
    run_scores, export_scores = (json.loads(_quiet("eval", "--ckpt", str(ckpt), *args)[1].splitlines()[-1])
                                 for ckpt in (run, exported))
    assert export_scores["bleu"] == run_scores["bleu"] and export_scores["chrf"] == run_scores["chrf"]


# ----------------------------------------------------------------------------- export, random weights

@pytest.mark.parametrize("changes", [
    dict(),
    dict(share_embeddings=False, output_bias=True, activation="silu"),
    dict(tie_weights=False, activation="gelu"),
    dict(activation="gelu_tanh", pad_id=3, bos_id=1, eos_id=0),
    dict(bos_id=0),
], ids=["paper", "separate-embeddings-bias-swish", "untied-gelu", "gelu-tanh-pad-inside", "start-from-pad"])
def test_any_marian_expressible_model_gives_transformers_logits_and_reads_back(changes, tmp_path):
    """Every logit but pad's (the zero vector Marian starts from, where the output is tied to it); read back,
    the same model, but where it started from pad itself: the start is then no token's embedding."""
    config = TransformerConfig(src_vocab_size=30, tgt_vocab_size=30, n_layers=2, n_decoder_layers=1, n_heads=4,
                               d_model=16, d_ff=32, max_len=24, dropout=0.0, pad_id=0, bos_id=1, eos_id=2,
                               source_eos=True).replace(**changes)
    torch.manual_seed(0)
    model = moved_off_start(Transformer(config)).eval()
    save_hf(model, tmp_path)
    hf = transformers.MarianMTModel.from_pretrained(tmp_path).eval()
    g = torch.Generator().manual_seed(1)
    real = torch.tensor([i for i in range(30) if i != config.pad_id])
    src, tgt = real[torch.randint(0, 29, (3, 7), generator=g)], real[torch.randint(0, 29, (3, 6), generator=g)]
    tgt[:, 0] = config.bos_id
    order, marian = marian_order(config), torch.argsort(marian_order(config))
    with torch.no_grad():
        ours = model(src, tgt)[0][..., order]
        hf_tgt = marian[tgt]
        hf_tgt[:, 0] = hf.config.decoder_start_token_id
        theirs = hf(input_ids=marian[src], decoder_input_ids=hf_tgt).logits
    columns = slice(None) if not config.tie_weights else slice(None, -1)
    assert (ours[..., columns] - theirs[..., columns]).abs().max() <= LOGITS_TOLERANCE
    if config.bos_id == config.pad_id:
        with pytest.raises(ValueError, match="no token's embedding"):
            load_marian(tmp_path)
        return
    back = load_marian(tmp_path)
    with torch.no_grad():
        again = back(marian[src], marian[tgt])[0]
    assert (ours[..., columns] - again[..., columns]).abs().max() <= LOGITS_TOLERANCE
    assert back.config.bos_id == marian[config.bos_id]


def test_marian_position_table_is_transformers_sinusoids():
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    expected = MarianSinusoidalPositionalEmbedding(40, 16).create_weight()
    assert (marian_table(40, 16) - expected).abs().max() <= 1e-6


@pytest.mark.parametrize("changes, field", [
    (dict(norm_first=True), "norm_first"),
    (dict(n_kv_heads=2), "n_kv_heads"),
    (dict(activation="swiglu"), "activation"),
    (dict(activation="relu2"), "activation"),
    (dict(source_eos=False), "source_eos"),
    (dict(share_embeddings=False, tgt_vocab_size=31), "src_vocab_size"),
])
def test_export_refuses_what_marian_cannot_express_naming_the_field(changes, field, tmp_path):
    config = TransformerConfig(src_vocab_size=30, tgt_vocab_size=30, n_layers=1, n_heads=4, d_model=16, d_ff=32,
                               max_len=24, pad_id=0, bos_id=1, eos_id=2, source_eos=True).replace(**changes)
    with pytest.raises(ValueError, match=field):
        save_marian(Transformer(config), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_tokenizer_marian_cannot_read(tmp_path):
    tokenizer = BPETokenizer.train(" ".join(corpus_lines(0, 200)), 300, special_tokens=("pad", "bos", "eos"))
    config = TransformerConfig(src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, n_layers=1,
                               n_heads=4, d_model=16, d_ff=32, max_len=24, source_eos=True)
    with pytest.raises(ValueError, match="SentencePiece"):
        save_marian(Transformer(config), tmp_path / "out", tokenizer=tokenizer)


# ----------------------------------------------------------------------------- import: opus-mt

@pytest.fixture(scope="module")
def opus(tmp_path_factory) -> Path:
    return opus_mt_directory(tmp_path_factory.mktemp("opus") / "opus-mt-en-xx")


def _hf_greedy(hf, tokenizer, texts: list[str], max_len: int) -> list[list[int]]:
    """transformers' greedy search as ours runs it: no token banned, none forced at the length limit."""
    outputs = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        out = hf.generate(input_ids=ids, num_beams=1, do_sample=False, bad_words_ids=None, forced_eos_token_id=None,
                          max_new_tokens=min(ids.shape[1] + EXTRA_OUTPUT_TOKENS, max_len))
        outputs.append(_until_eos(out[0, 1:].tolist(), hf.config.eos_token_id))
    return outputs


def test_an_opus_mt_directory_translates_as_transformers_does(opus):
    hf = transformers.MarianMTModel.from_pretrained(opus).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(opus)
    ours = load_hf(opus)
    assert isinstance(ours, Transformer)
    config = ours.config
    assert (config.activation, config.output_bias, config.bos_id) == ("silu", True, hf.config.pad_token_id)
    texts = corpus_lines(2000, 12)
    assert [ours.tokenizer.encode(t) + [ours.config.eos_id] for t in texts] == tokenizer(texts)["input_ids"]
    theirs = _hf_greedy(hf, tokenizer, texts, ours.config.max_len)
    sources = [torch.tensor(ids) for ids in _sources(ours, texts)]
    ours_tokens = [_until_eos(ours.generate(src[None])[0, 1:].tolist(), ours.config.eos_id) for src in sources]
    assert ours_tokens == theirs
    assert ours.translate(texts) == tokenizer.batch_decode(theirs, skip_special_tokens=True)
    g = torch.Generator().manual_seed(0)
    src = pad_sequence(sources, batch_first=True, padding_value=ours.config.pad_id)
    tgt = torch.randint(0, ours.config.tgt_vocab_size - 1, (len(texts), 9), generator=g)
    tgt[:, 0] = ours.config.bos_id
    with torch.no_grad():
        error = (ours(src, tgt)[0] - hf(input_ids=src, attention_mask=src != ours.config.pad_id,
                                        decoder_input_ids=tgt).logits).abs().max().item()
    assert error <= LOGITS_TOLERANCE, f"max |logit difference| {error:.3g}"


def test_translate_takes_an_opus_mt_directory(opus):
    hf = transformers.MarianMTModel.from_pretrained(opus).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(opus)
    text = corpus_lines(2100, 1)[0]
    status, stdout = _quiet("translate", "--ckpt", str(opus), "--beam", "1", text)
    expected = tokenizer.batch_decode(_hf_greedy(hf, tokenizer, [text], 64), skip_special_tokens=True)
    assert status == 0 and stdout.splitlines() == expected


def test_older_weights_with_each_alias_and_the_position_tables_load_the_same(opus, tmp_path):
    """An older opus-mt pytorch_model.bin holds every name of the shared matrix and both position tables."""
    shutil.copytree(opus, tmp_path / "old")
    hf = transformers.MarianMTModel.from_pretrained(opus)
    (tmp_path / "old" / "model.safetensors").unlink()
    state = {name: tensor.contiguous() for name, tensor in hf.state_dict().items()}
    assert "model.encoder.embed_positions.weight" in state and "lm_head.weight" in state
    torch.save(state, tmp_path / "old" / "pytorch_model.bin")
    new, old = load_marian(opus), load_marian(tmp_path / "old")
    for (name, a), b in zip(new.state_dict().items(), old.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_an_imported_model_exports_to_the_directory_it_came_from(opus, tmp_path):
    save_marian(load_marian(opus), tmp_path)
    original = transformers.MarianMTModel.from_pretrained(opus).eval()
    again = transformers.MarianMTModel.from_pretrained(tmp_path).eval()
    src, tgt = torch.tensor([[5, 9, 13, 0]]), torch.tensor([[original.config.pad_token_id, 7, 3, 3]])
    with torch.no_grad():
        assert (original(input_ids=src, decoder_input_ids=tgt).logits
                - again(input_ids=src, decoder_input_ids=tgt).logits).abs().max() <= LOGITS_TOLERANCE
    assert json.loads((tmp_path / "vocab.json").read_text()) == json.loads((opus / "vocab.json").read_text())


@pytest.mark.parametrize("changes, field", [
    (dict(scale_embedding=False), "scale_embedding"),
    (dict(decoder_vocab_size=300), "decoder_vocab_size"),
    (dict(activation_function="tanh"), "activation_function"),
    (dict(decoder_ffn_dim=64), "decoder_ffn_dim"),
])
def test_import_refuses_what_plainformer_cannot_read_naming_the_field(changes, field, tmp_path):
    directory = tmp_path / "opus"
    opus_mt_model(40, **changes).save_pretrained(directory)
    with pytest.raises(ValueError, match=field):
        load_marian(directory)


def test_import_refuses_position_tables_that_are_not_the_sinusoids(opus, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(opus, tmp_path / "odd")
    state = load_file(tmp_path / "odd" / "model.safetensors")
    state["model.encoder.embed_positions.weight"] = torch.zeros(64, 16)
    save_file(state, tmp_path / "odd" / "model.safetensors")
    with pytest.raises(ValueError, match="embed_positions"):
        load_marian(tmp_path / "odd")
