"""`plainformer attention` end to end on the `default` preset trained 3 steps (tests/cli/conftest.py):
attention maps plotted from MultiHeadAttention(need_weights=True), and the HTML explorer."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from PIL import Image

import plainformer as pf
from plainformer.cli import attention as cli_attention
from plainformer.cli import main
from plainformer.models.attention_maps import attention_maps, figure_size, visible

TEXT = "To be, or not to be"


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err



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
    real = cli_attention.plot_attention_maps

    def spy(weights, path, **labels):
        plotted.append((weights, labels))
        return real(weights, path, **labels)

    monkeypatch.setattr(cli_attention, "plot_attention_maps", spy)
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
