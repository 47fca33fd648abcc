"""`plainformer export` end to end: the `default` preset trained 3 steps (tests/cli/conftest.py), exported
as a Hugging Face directory, a GGUF file or a LoRA adapter, and opened by transformers, llama.cpp, PEFT."""

from __future__ import annotations

import json
import os
import stat
import subprocess

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
import transformers

import plainformer as pf
from plainformer.cli import main

TOLERANCE = 1e-4  # fp32 logits
TEXT = "To be, or not to be"


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err



@pytest.fixture(scope="module")
def corpus_lines() -> list[str]:
    return [line for line in pf.load_text().splitlines() if line.strip()][:1000]


def test_exported_default_run_opens_in_transformers_with_equal_ids_logits_and_greedy_text(
        run, corpus_lines, capsys, tmp_path):
    code, stdout, _ = run_cli(capsys, "export", "--ckpt", run, "--out", tmp_path / "hf")
    assert code == 0
    assert json.loads(stdout.splitlines()[-1]) == {"out": str(tmp_path / "hf"), "model_type": "llama",
                                                   "architecture": "LlamaForCausalLM", "tokenizer": "char"}
    ours = pf.GPT.from_checkpoint(run / "best")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer(corpus_lines)["input_ids"] == [ours.tokenizer.encode(line) for line in corpus_lines]

    ids = torch.tensor([ours.tokenizer.encode(corpus_lines[0] + "\n" + corpus_lines[1])])
    with torch.no_grad():
        assert (ours(ids)[0] - model(ids).logits).abs().max().item() <= TOLERANCE
    prompt = torch.tensor([ours.tokenizer.encode(TEXT)])
    theirs = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert tokenizer.decode(theirs[0]) == ours.tokenizer.decode(ours.generate(prompt, 32, temperature=0.0)[0])


def test_export_of_a_sliding_window_run_gives_mistral_and_its_gguf_is_refused_naming_the_window(capsys, tmp_path):
    tokenizer = pf.CharTokenizer(pf.load_text())
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layers=2, n_heads=2, d_model=16,
                                d_ff=32, dropout=0.0, norm="rmsnorm", activation="swiglu", pos_encoding="rope",
                                bias=False, sliding_window=4)).eval()
    pf.save_checkpoint(tmp_path / "run", model=model, family="gpt", model_config=model.config.to_dict(),
                       tokenizer=tokenizer)
    code, stdout, stderr = run_cli(capsys, "export", "--ckpt", tmp_path / "run", "--out", tmp_path / "m.gguf")
    assert code == 2 and stdout == "" and len(stderr.splitlines()) == 1
    assert stderr.startswith("plainformer: error: sliding_window=4 has no GGUF layout here")
    assert not (tmp_path / "m.gguf").exists()
    code, stdout, _ = run_cli(capsys, "export", "--ckpt", tmp_path / "run", "--out", tmp_path / "hf")
    assert code == 0 and json.loads(stdout.splitlines()[-1])["architecture"] == "MistralForCausalLM"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([tokenizer.encode(TEXT)])  # 19 tokens > 2w
    with torch.no_grad():
        assert (model(ids)[0] - theirs(ids).logits).abs().max().item() <= TOLERANCE


def test_export_on_a_full_disk_says_so_in_one_line_and_leaves_no_directory(run, capsys, small_tmpfs):
    code, stdout, stderr = run_cli(capsys, "export", "--ckpt", run, "--out", small_tmpfs / "hf")
    assert code == 2 and stdout == ""
    assert stderr.splitlines() == [f"plainformer: error: the disk is full: could not write the file "
                                   f"{small_tmpfs / 'hf' / 'model.safetensors'}; free space on the file system "
                                   f"of {small_tmpfs / 'hf'} and retry"]
    assert list(small_tmpfs.iterdir()) == []


def test_export_of_a_bert_checkpoint_gives_transformers_bert_and_its_tokenizer(capsys, tmp_path):
    tokenizer = pf.WordPieceTokenizer.train(pf.load_text()[:50_000], 300)
    config = pf.BertConfig(vocab_size=tokenizer.vocab_size, max_len=32, n_layers=1, n_heads=2, d_model=16, d_ff=32)
    torch.manual_seed(0)
    model = pf.BertForMaskedLM(config).eval()
    pf.save_checkpoint(tmp_path / "ckpt", model=model, family="bert-mlm", model_config=config.to_dict(),
                       tokenizer=tokenizer)
    code, stdout, _ = run_cli(capsys, "export", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "hf")
    assert code == 0 and json.loads(stdout.splitlines()[-1])["model_type"] == "bert"
    theirs = transformers.BertModel.from_pretrained(tmp_path / "hf").eval()
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(TEXT, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == tokenizer.encode(TEXT)
    with torch.no_grad():
        error = (model.bert(ids).last_hidden_state - theirs(ids).last_hidden_state).abs().max().item()
    assert error <= TOLERANCE


def test_export_refuses_a_missing_checkpoint(capsys, tmp_path):
    code, _, stderr = run_cli(capsys, "export", "--ckpt", tmp_path / "nothing", "--out", tmp_path / "hf")
    assert code == 2 and stderr.startswith("plainformer: error: --ckpt") and "does not exist" in stderr


def test_sample_and_eval_take_a_hugging_face_directory_as_ckpt(run, capsys, tmp_path):
    assert run_cli(capsys, "export", "--ckpt", run, "--out", tmp_path / "hf")[0] == 0
    greedy = ("sample", "--prompt", TEXT, "--max-new-tokens", "16", "--temperature", "0")
    code, from_run, _ = run_cli(capsys, *greedy, "--ckpt", run)
    assert code == 0
    code, from_hf, _ = run_cli(capsys, *greedy, "--ckpt", tmp_path / "hf")
    assert code == 0 and from_hf == from_run
    text = tmp_path / "small.txt"  # a little of the corpus: its characters are in the vocabulary
    text.write_text(pf.load_text()[:20_000], encoding="utf-8")
    evaluations = []
    for ckpt in (run / "best", tmp_path / "hf"):
        code, stdout, _ = run_cli(capsys, "eval", "--ckpt", ckpt, "--data", text)
        assert code == 0
        evaluations.append(json.loads(stdout.splitlines()[-1]))
    assert evaluations[1]["tokens"] == evaluations[0]["tokens"]
    assert evaluations[1]["val_loss"] == pytest.approx(evaluations[0]["val_loss"], abs=1e-5)


# ----------------------------------------------------------------------------- export: GGUF and LoRA adapters

def test_export_to_gguf_runs_in_llama_cpp_with_our_ids_and_greedy_tokens(run, capsys, tmp_path):
    from tests.reference.llama_cpp import llama_cpp

    code, stdout, _ = run_cli(capsys, "export", "--ckpt", run, "--out", tmp_path / "model.gguf")
    assert code == 0
    path = tmp_path / "model.gguf"
    assert json.loads(stdout.splitlines()[-1]) == {"out": str(path), "format": "gguf", "gguf_type": "f32",
                                                   "bytes": path.stat().st_size, "tokenizer": "char"}
    ours = pf.GPT.from_checkpoint(run / "best")
    ids = ours.tokenizer.encode(TEXT)
    with llama_cpp(path, ours.config.block_size) as runtime:
        assert runtime.tokenize(TEXT) == ids
        assert runtime.greedy(ids, 16) == ours.generate(torch.tensor([ids]), 16, temperature=0.0)[0, len(ids):].tolist()


def test_export_format_gguf_and_gguf_type_q8_0_write_llama_cpp_s_blocks(run, capsys, tmp_path):
    import gguf

    code, _, _ = run_cli(capsys, "export", "--ckpt", run, "--out", tmp_path / "model", "--format", "gguf",
                         "--gguf-type", "q8_0")
    assert code == 0
    reader = gguf.GGUFReader(tmp_path / "model")
    assert int(reader.fields["general.file_type"].parts[-1][0]) == gguf.LlamaFileType.MOSTLY_Q8_0
    types = gguf.GGMLQuantizationType
    matrices = [t for t in reader.tensors if len(t.shape) > 1]
    # a row (ggml's first dimension) a multiple of 32 long is in blocks; another is written f16
    assert {t.name: t.tensor_type for t in matrices} == {
        t.name: types.Q8_0 if t.shape[0] % 32 == 0 else types.F16 for t in matrices}
    assert sum(t.tensor_type == types.Q8_0 for t in matrices) > len(matrices) // 2


def _checkpoint(path: Path, family: str) -> Path:
    """A small BERT (masked LM) or encoder-decoder checkpoint: families without a GGUF layout."""
    tokenizer = pf.BPETokenizer.train(pf.load_text()[:20_000], 300, special_tokens=("pad", "bos", "eos"))
    if family == "bert-mlm":
        config = pf.BertConfig(vocab_size=tokenizer.vocab_size, max_len=16, n_layers=1, n_heads=2, d_model=16, d_ff=32)
        model = pf.BertForMaskedLM(config)
    else:
        config = pf.TransformerConfig(src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size,
                                      max_len=16, n_layers=1, n_heads=2, d_model=16, d_ff=32, pad_id=tokenizer.pad_id,
                                      bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
        model = pf.Transformer(config)
    pf.save_checkpoint(path, model=model, family=family, model_config=config.to_dict(), tokenizer=tokenizer)
    return path


@pytest.mark.parametrize("argv, message", [
    (["--out", "{tmp}/m.gguf", "--gguf-type", "q4_0"], "argument --gguf-type: invalid choice: 'q4_0'"),
    (["--out", "{tmp}/dir", "--gguf-type", "f16"], "--gguf-type sets the weights of a GGUF file"),
    (["--out", "{tmp}/m.gguf", "--adapter"], "--adapter writes an adapter directory in PEFT's format"),
    (["--out", "{tmp}/dir", "--adapter"], "holds none (fine-tune with --lora-r to make one)"),
])
def test_export_refuses_mismatched_flags_in_one_line(run, capsys, tmp_path, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, stdout, stderr = run_cli(capsys, "export", "--ckpt", run, *argv)
    assert code == 2 and stdout == "" and len(stderr.splitlines()) == 1
    assert stderr.startswith("plainformer: error: ") and message in stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("family, model", [("bert-mlm", "BertForMaskedLM"), ("transformer", "Transformer")])
def test_export_of_a_bert_or_an_encoder_decoder_to_gguf_is_refused_in_one_line(capsys, tmp_path, family, model):
    ckpt = _checkpoint(tmp_path / "ckpt", family)
    code, stdout, stderr = run_cli(capsys, "export", "--ckpt", ckpt, "--out", tmp_path / "model.gguf")
    assert code == 2 and stdout == ""
    assert stderr == (f"plainformer: error: a {model} has no GGUF layout here; a GGUF export takes a GPT "
                      "(GPT-2 or Llama layout)\n")
    assert not (tmp_path / "model.gguf").exists()


def test_export_of_an_encoder_decoder_marian_cannot_express_is_refused_in_one_line(capsys, tmp_path):
    """A built-in task's model: sources without </s>, which Marian's tokenizer always appends."""
    ckpt = _checkpoint(tmp_path / "ckpt", "transformer")
    code, stdout, stderr = run_cli(capsys, "export", "--ckpt", ckpt, "--out", tmp_path / "marian")
    assert code == 2 and stdout == "" and len(stderr.splitlines()) == 1
    assert stderr.startswith("plainformer: error: source_eos=False: Marian's tokenizer ends every source with </s>")
    assert not (tmp_path / "marian").exists()


def test_export_to_gguf_on_a_full_disk_is_one_line_and_leaves_nothing(
        run, capsys, small_tmpfs):
    code, stdout, stderr = run_cli(capsys, "export", "--ckpt", run, "--out", small_tmpfs / "model.gguf")
    assert code == 2 and stdout == ""
    assert stderr == (f"plainformer: error: the disk is full: could not write the file {small_tmpfs / 'model.gguf'}; "
                      f"free space on the file system of {small_tmpfs} and retry\n")
    assert list(small_tmpfs.iterdir()) == []


def test_export_to_gguf_into_a_read_only_folder_names_the_file(run, capsys, read_only_tmpfs):
    code, _, stderr = run_cli(capsys, "export", "--ckpt", run, "--out", read_only_tmpfs / "model.gguf")
    assert code == 2
    assert stderr == f"plainformer: error: cannot write {read_only_tmpfs / 'model.gguf'}: Read-only file system\n"


LORA_TRAINING = ["--max-steps", "4", "--lr", "3e-2", "--batch-size", "2", "--eval-interval", "2", "--eval-batches",
                 "1", "--warmup-steps", "1", "--no-progress", "--dtype", "float32", "--lora-r", "4"]


def _lora_run(capsys, monkeypatch, tmp_path: Path, base: Path) -> Path:
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data.txt"
    data.write_text(pf.load_text()[:20_000], encoding="utf-8")
    code, _, stderr = run_cli(capsys, "finetune", "--init", base, "--data", data, "--out", tmp_path / "lora",
                              *LORA_TRAINING)
    assert code == 0, stderr
    return tmp_path / "lora"


def test_export_adapter_of_a_llama_base_loads_in_peft_and_equals_the_merged_export(
        run, capsys, monkeypatch, tmp_path):
    peft = pytest.importorskip("peft")
    assert run_cli(capsys, "export", "--ckpt", run, "--out", tmp_path / "base")[0] == 0
    lora = _lora_run(capsys, monkeypatch, tmp_path, tmp_path / "base")
    code, stdout, _ = run_cli(capsys, "export", "--ckpt", lora, "--out", tmp_path / "adapter", "--adapter")
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                         "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    assert json.loads(stdout.splitlines()[-1])["base_model_name_or_path"] == config["base_model_name_or_path"]
    assert run_cli(capsys, "export", "--ckpt", lora, "--out", tmp_path / "merged")[0] == 0

    ids = torch.tensor([pf.GPT.from_checkpoint(run / "best").tokenizer.encode(TEXT)])
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        before = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()  # adapts `base` in place
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert (adapted(ids).logits - merged(ids).logits).abs().max().item() <= TOLERANCE
        assert (adapted(ids).logits - before).abs().max().item() > 100 * TOLERANCE  # the adapter moved it


def test_export_adapter_of_a_gpt2_base_is_refused_in_one_line(capsys, monkeypatch, tmp_path):
    tokenizer = pf.CharTokenizer(pf.load_text()[:20_000])
    config = pf.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layers=1, n_heads=2, d_model=16, d_ff=32,
                          pos_encoding="learned", norm="layernorm", activation="gelu_tanh", bias=True, dropout=0.0)
    pf.save_hf(pf.GPT(config), tmp_path / "gpt2", tokenizer=tokenizer)
    lora = _lora_run(capsys, monkeypatch, tmp_path, tmp_path / "gpt2")
    code, stdout, stderr = run_cli(capsys, "export", "--ckpt", lora, "--out", tmp_path / "adapter", "--adapter")
    assert code == 2 and stdout == "" and len(stderr.splitlines()) == 1
    assert "has no PEFT form" in stderr and "c_attn" in stderr
    assert not (tmp_path / "adapter").exists()
    assert run_cli(capsys, "export", "--ckpt", lora, "--out", tmp_path / "merged.gguf")[0] == 0  # merged is fine


def test_the_base_s_chat_template_rides_into_the_hf_export_and_the_gguf(capsys, tmp_path):
    import gguf

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer = pf.CharTokenizer(pf.load_text()[:20_000])
    config = pf.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layers=1, n_heads=2, d_model=32, d_ff=64,
                          pos_encoding="rope", norm="rmsnorm", activation="swiglu", bias=False, dropout=0.0)
    pf.save_hf(pf.GPT(config), tmp_path / "base", tokenizer=tokenizer)
    settings = json.loads((tmp_path / "base" / "tokenizer_config.json").read_text())
    (tmp_path / "base" / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": template}))
    assert run_cli(capsys, "export", "--ckpt", tmp_path / "base", "--out", tmp_path / "hf")[0] == 0
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"] == template
    assert run_cli(capsys, "export", "--ckpt", tmp_path / "base", "--out", tmp_path / "m.gguf")[0] == 0
    field = gguf.GGUFReader(tmp_path / "m.gguf").fields["tokenizer.chat_template"]
    assert bytes(field.parts[-1]).decode() == template


def test_export_to_a_fifo_or_a_device_is_refused_in_one_line_and_leaves_it_as_it_is(run, capsys, tmp_path):
    os.mkfifo(tmp_path / "pipe")
    os.mknod(tmp_path / "full", 0o666 | stat.S_IFCHR, os.makedev(1, 7))  # /dev/full's numbers; the suite runs as root
    for target in (tmp_path / "pipe", tmp_path / "full"):
        kind = stat.S_IFMT(target.lstat().st_mode)
        code, stdout, stderr = run_cli(capsys, "export", "--ckpt", run, "--out", target, "--format", "gguf")
        assert code == 2 and stdout == ""
        assert stderr.startswith(f"plainformer: error: {target} is a ") and len(stderr.splitlines()) == 1
        assert stat.S_IFMT(target.lstat().st_mode) == kind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "pipe"]


def test_export_to_gguf_over_a_directory_is_refused_in_one_line(run, capsys, tmp_path):
    (tmp_path / "x.gguf").mkdir()
    code, _, stderr = run_cli(capsys, "export", "--ckpt", run, "--out", tmp_path / "x.gguf")
    assert code == 2
    assert stderr == (f"plainformer: error: --out {tmp_path / 'x.gguf'} is a directory; a GGUF export writes one file: "
                      "give --out FILE.gguf\n")


@pytest.mark.parametrize("inside", ["best", "best/hf", "last/model.gguf", ".", "plots/x.gguf"])
def test_export_into_a_run_or_its_checkpoint_is_refused_and_leaves_the_checkpoint_whole(run, capsys, inside):
    before = {p: p.read_bytes() for p in (run / "best").iterdir()}
    code, stdout, stderr = run_cli(capsys, "export", "--ckpt", run, "--out", run / inside)
    assert code == 2 and stdout == ""
    holder = run / "best" if inside.startswith("best") else run / "last" if inside.startswith("last") else run
    assert stderr == (f"plainformer: error: --out {run / inside} is inside the run or checkpoint directory "
                      f"{holder}, whose files it could replace; write it outside that directory\n")
    assert {p: p.read_bytes() for p in (run / "best").iterdir()} == before
    assert pf.GPT.from_checkpoint(run / "best") is not None  # its manifest still verifies


def test_export_through_a_symbolic_link_writes_the_file_it_names(run, capsys, tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "latest.gguf").symlink_to(tmp_path / "models" / "v1.gguf")
    code, _, stderr = run_cli(capsys, "export", "--ckpt", run, "--out", tmp_path / "latest.gguf")
    assert code == 0, stderr
    assert (tmp_path / "latest.gguf").is_symlink()
    assert (tmp_path / "models" / "v1.gguf").read_bytes()[:4] == b"GGUF"


def test_an_export_removes_the_temporaries_a_killed_export_left(run, capsys, tmp_path):
    killed = subprocess.Popen(["sleep", "60"])
    killed.kill()
    killed.wait()
    (tmp_path / "hf").mkdir()
    left = [tmp_path / f".model.gguf.tmp-{killed.pid}-0123456789ab",
            tmp_path / "hf" / f".model.safetensors.tmp-{killed.pid}-0123456789ab"]
    for temporary in left:
        temporary.write_bytes(bytes(1 << 20))
    assert run_cli(capsys, "export", "--ckpt", run, "--out", tmp_path / "model.gguf")[0] == 0
    assert run_cli(capsys, "export", "--ckpt", run, "--out", tmp_path / "hf")[0] == 0
    assert not any(temporary.exists() for temporary in left)


def test_an_export_name_of_250_characters_is_written(run, capsys, tmp_path):
    out = tmp_path / ("m" * 245 + ".gguf")
    code, _, stderr = run_cli(capsys, "export", "--ckpt", run, "--out", out)
    assert code == 0, stderr
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
