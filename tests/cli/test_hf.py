"""`plainformer export` and `plainformer attention` end to end: the `default` preset trained 3 steps,
exported and opened by transformers; attention maps plotted from MultiHeadAttention(need_weights=True)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image

import plainformer as pf
from plainformer.cli import hf as cli_hf
from plainformer.cli import main
from plainformer.cli import train as cli_train
from plainformer.models.attention_maps import attention_maps, figure_size, visible

TOLERANCE = 1e-4  # fp32 logits
TEXT = "To be, or not to be"


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The `default` preset (Llama-shaped, char tokenizer) trained 3 steps on the bundled corpus."""
    out = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLAINFORMER_CACHE", str(out / "cache"))
        patch.setattr(cli_train, "matmul_rate", lambda dtype, seconds: 1e15)  # its 4 x 256 shape on any machine
        assert main(["train", "--preset", "default", "--out", str(out), "--max-steps", "3", "--batch-size", "2",
                     "--eval-batches", "1", "--no-progress"]) == 0
    return out


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


def _reference_gpt_weights(model: pf.GPT, ids: list[int]) -> torch.Tensor:
    """Each block's MultiHeadAttention called with need_weights=True on its pre-LN input, (L, H, n, n)."""
    x = model.token_embedding(torch.tensor([ids]))
    weights = []
    with torch.no_grad():
        for block in model.blocks:
            h = block.norm1(x)
            out, w = block.self_attn(h, h, h, is_causal=True, rope=model.rope, need_weights=True)
            weights.append(w[0])
            x = x + out
            x = x + block.ff(block.norm2(x))
    return torch.stack(weights)


def _capture_plotted(monkeypatch) -> list:
    plotted = []
    real = cli_hf.plot_attention_maps

    def spy(weights, path, **labels):
        plotted.append((weights, labels))
        return real(weights, path, **labels)

    monkeypatch.setattr(cli_hf, "plot_attention_maps", spy)
    return plotted


def test_attention_plots_the_need_weights_maps_in_a_png_of_the_grid_size(run, capsys, monkeypatch, tmp_path):
    plotted = _capture_plotted(monkeypatch)
    code, stdout, _ = run_cli(capsys, "attention", "--ckpt", run, "--text", TEXT, "--out", tmp_path / "attn.png")
    assert code == 0
    model = pf.GPT.from_checkpoint(run / "best")
    ids = model.tokenizer.encode(TEXT)
    config = model.config
    assert json.loads(stdout.splitlines()[-1]) == {"out": str(tmp_path / "attn.png"), "layers": config.n_layers,
                                                   "heads": config.n_heads, "queries": len(ids), "keys": len(ids)}
    assert Image.open(tmp_path / "attn.png").size == figure_size(config.n_layers, config.n_heads, len(ids), len(ids))
    weights, labels = plotted[0]
    assert (weights - _reference_gpt_weights(model, ids)).abs().max().item() <= 1e-5
    assert labels["queries"] == labels["keys"] == [visible(c) for c in TEXT]  # spaces shown as ␣


def test_attention_of_one_layer_and_head_and_from_a_hugging_face_directory(run, capsys, monkeypatch, tmp_path):
    assert run_cli(capsys, "export", "--ckpt", run, "--out", tmp_path / "hf")[0] == 0
    plotted = _capture_plotted(monkeypatch)
    code, _, _ = run_cli(capsys, "attention", "--ckpt", tmp_path / "hf", "--text", TEXT,
                         "--out", tmp_path / "one.png", "--layer", "1", "--head", "2")
    assert code == 0
    model = pf.GPT.from_checkpoint(run / "best")
    expected = _reference_gpt_weights(model, model.tokenizer.encode(TEXT))[1:2, 2:3]
    assert (plotted[0][0] - expected).abs().max().item() <= 1e-5
    assert Image.open(tmp_path / "one.png").size == figure_size(1, 1, len(TEXT), len(TEXT))


def test_export_on_a_full_disk_says_so_in_one_line_and_leaves_no_directory(run, capsys, small_tmpfs):
    code, stdout, stderr = run_cli(capsys, "export", "--ckpt", run, "--out", small_tmpfs / "hf")
    assert code == 2 and stdout == ""
    assert stderr.splitlines() == [f"plainformer: error: the disk is full: could not write the file "
                                   f"{small_tmpfs / 'hf' / 'model.safetensors'}; free space on the file system "
                                   f"of {small_tmpfs / 'hf'} and retry"]
    assert list(small_tmpfs.iterdir()) == []


def test_attention_into_a_read_only_folder_names_the_file_not_a_temporary(run, capsys, read_only_tmpfs):
    for flag, name in (("--out", "attn.png"), ("--html", "attn.html")):
        code, _, stderr = run_cli(capsys, "attention", "--ckpt", run, "--text", TEXT, flag, read_only_tmpfs / name)
        assert code == 2
        assert stderr == f"plainformer: error: cannot write {read_only_tmpfs / name}: Read-only file system\n"


def test_attention_html_writes_the_explorer_of_the_run_and_of_its_hugging_face_export(run, capsys, tmp_path):
    model = pf.GPT.from_checkpoint(run / "best")
    ids = torch.tensor(model.tokenizer.encode(TEXT))
    assert run_cli(capsys, "export", "--ckpt", run, "--out", tmp_path / "hf")[0] == 0
    for ckpt in (run, tmp_path / "hf"):
        page_path = tmp_path / ckpt.name / "attention.html"
        code, stdout, _ = run_cli(capsys, "attention", "--ckpt", ckpt, "--text", TEXT, "--html", page_path)
        assert code == 0
        page = page_path.read_text(encoding="utf-8")
        assert json.loads(stdout.splitlines()[-1]) == {"html": str(page_path), "bytes": len(page.encode())}
        data = json.loads(page.split('id="attention-data">')[1].split("</script>")[0])
        embedded = torch.tensor(data["weights"])
        assert (embedded - attention_maps(model, ids)).abs().max().item() <= 0.5e-3 + 1e-6  # 3 decimals
        assert len(data["next_tokens"]) == len(ids) and data["tokens"] == [visible(c) for c in TEXT]


@pytest.mark.parametrize("argv, message", [
    ([], "give --out (a PNG of the maps), --html (the explorer page) or both"),
    (["--html", "a.html", "--layer", "1"],
     "--layer and --head choose what the PNG --out shows; the --html page holds every one"),
    (["--html", "a.html", "--decimals", "9"], "--decimals must be in [1, 6], got 9"),
])
def test_attention_outputs_are_checked_before_the_model_loads(capsys, tmp_path, argv, message):
    code, stdout, stderr = run_cli(capsys, "attention", "--ckpt", tmp_path / "missing", "--text", "a", *argv)
    assert code == 2 and stdout == "" and stderr == f"plainformer: error: {message}\n"


@pytest.mark.parametrize("extra, message", [
    (["--head", "9"], "--head must be in [0, 4)"),
    (["--layer", "-1"], "--layer must be in [0, 4)"),
    (["--source", "a", "--target", "b"], "give --text"),
])
def test_attention_user_errors_print_one_line(run, capsys, tmp_path, extra, message):
    text = [] if "--source" in extra else ["--text", TEXT]
    argv = ["attention", "--ckpt", run, "--out", tmp_path / "x.png", *text]
    code, stdout, stderr = run_cli(capsys, *argv, *extra)
    assert code == 2 and stdout == ""
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("plainformer: error: ")
    assert message in stderr
    assert not (tmp_path / "x.png").exists()


def test_cross_attention_of_an_encoder_decoder_checkpoint(capsys, monkeypatch, tmp_path):
    tokenizer = pf.BPETokenizer.train(pf.load_text()[:50_000], 300, special_tokens=("pad", "bos", "eos"))
    config = pf.TransformerConfig(src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size,
                                  max_len=32, n_layers=2, n_heads=2, d_model=16, d_ff=32, pad_id=tokenizer.pad_id,
                                  bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    torch.manual_seed(0)
    model = pf.Transformer(config).eval()
    pf.save_checkpoint(tmp_path / "ckpt", model=model, family="transformer", model_config=config.to_dict(),
                       tokenizer=tokenizer)
    plotted = _capture_plotted(monkeypatch)
    code, stdout, _ = run_cli(capsys, "attention", "--ckpt", tmp_path / "ckpt", "--source", "the king",
                              "--target", "der König", "--out", tmp_path / "cross.png")
    assert code == 0
    source, target = tokenizer.encode("the king"), [tokenizer.bos_id, *tokenizer.encode("der König")]
    weights, labels = plotted[0]
    assert weights.shape == (2, 2, len(target), len(source))
    assert labels["queries"][0] == "<bos>" and len(labels["keys"]) == len(source)
    expected = attention_maps(model, torch.tensor(source), torch.tensor(target))
    assert torch.equal(weights, expected)
    assert Image.open(tmp_path / "cross.png").size == figure_size(2, 2, len(target), len(source))


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
