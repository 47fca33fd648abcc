"""The encoder-decoder on real parallel data through the command line (families/transformer.py's translation
path; the built-in tasks are tests/families/test_transformer.py's): a slice of Multi30k trains in seconds and its
validation BLEU rises above a floor; translate and eval read the run back; bad data is one line, exit 2, and no run
directory."""

from __future__ import annotations

import gzip
import io
import json
import sys
from pathlib import Path

import pytest

import plainformer as pf
from plainformer.cli import main
from tests.reference.shared_data import shared_data

TINY = ["--n-layers", "1", "--d-model", "64", "--n-heads", "4", "--d-ff", "128", "--vocab-size", "1000",
        "--batch-tokens", "1500", "--warmup-steps", "60", "--max-time", "10000"]
# Validation BLEU after 200 steps on 3,000 pairs: 4.6 here (an untrained model scores 0): a learned result, so a
# floor well under it.
BLEU_FLOOR = 2.0


def _run(capsys, *argv: str) -> tuple[int, list[str], str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


def _slice(folder: Path, split: str, pairs: int, extra: tuple[str, str] | None = None) -> Path:
    """The first `pairs` pairs of a Multi30k split as line-aligned files folder/split.{de,en}."""
    folder.mkdir(parents=True, exist_ok=True)
    for side, lang in enumerate(("de", "en")):
        lines = gzip.open(shared_data("multi30k") / f"{split}.{lang}.gz", "rt", encoding="utf-8").read().splitlines()
        lines = lines[:pairs] + ([extra[side]] if extra else [])
        (folder / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder / split


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("multi30k")
    return _slice(folder, "train", 3000, extra=("", "an empty source")), _slice(folder, "val", 100)


@pytest.fixture(scope="module")
def run(data, tmp_path_factory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("run") / "run"
    with pytest.MonkeyPatch.context() as patch, _captured() as captured:
        patch.setenv("PLAINFORMER_CACHE", str(out.parent / "cache"))
        status = main(["train", "--preset", "multi30k-de-en", "--data", str(data[0]), "--val-data", str(data[1]),
                       "--out", str(out), "--max-steps", "200", "--eval-interval", "100", "--save-interval", "50",
                       "--keep-checkpoints", "3", "--no-progress", *TINY])
    assert status == 0, captured.err
    return out, json.loads(captured.out.strip().splitlines()[-1]), captured.err


class _captured:
    """stdout and stderr of the block, as text."""

    def __enter__(self):
        self._streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
        return self

    def __exit__(self, *exc):
        self.out, self.err = sys.stdout.getvalue(), sys.stderr.getvalue()
        sys.stdout, sys.stderr = self._streams


def test_a_slice_of_multi30k_trains_in_seconds_and_its_validation_bleu_rises_above_a_floor(run):
    out, metrics, err = run
    assert metrics["step"] == 200 and metrics["best_val_bleu"] >= BLEU_FLOOR
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    bleus = [(r["step"], r["val_bleu"]) for r in logged if "val_bleu" in r]
    assert [step for step, _ in bleus] == [100, 200] and all("val_chrf" in r for r in logged if "val_bleu" in r)
    assert "3,000 pairs kept, 1 dropped (1 with an empty side)" in err
    assert metrics["averaged"] == 3 and (out / "averaged" / "model.safetensors").is_file()
    assert metrics["best_val_bleu"] == max(metrics["averaged_val_bleu"], *(bleu for _, bleu in bleus))


def test_translate_reads_a_file_or_stdin_and_writes_in_the_input_order(run, data, capsys, tmp_path, monkeypatch):
    sources = (data[1].parent / "val.de").read_text(encoding="utf-8").splitlines()[:30]
    (tmp_path / "in.de").write_text("\n".join(sources) + "\n", encoding="utf-8")
    status, lines, _ = _run(capsys, "translate", "--ckpt", str(run[0]), "--input", str(tmp_path / "in.de"),
                            "--batch-size", "8")
    model = pf.Transformer.from_checkpoint(run[0] / "best")
    assert status == 0 and lines == [model.translate([s], beam_size=4)[0] for s in sources]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(sources[:5]).encode())))
    status, from_stdin, _ = _run(capsys, "translate", "--ckpt", str(run[0]), "--batch-size", "2")
    assert status == 0 and from_stdin == lines[:5]


def test_eval_scores_a_source_reference_pair_with_bleu_chrf_and_tokenized_bleu(run, data, capsys):
    status, lines, err = _run(capsys, "eval", "--ckpt", str(run[0]), "--data", str(data[1]), "--beam", "1")
    assert status == 0 and len(lines) == 1
    metrics = json.loads(lines[0])
    assert (metrics["source_lang"], metrics["target_lang"], metrics["sentences"]) == ("de", "en", 100)
    assert {"bleu", "chrf", "tokenized_bleu"} <= set(metrics) and metrics["bleu"] > 0
    assert f"tokenized BLEU {metrics['tokenized_bleu']:.2f}" in err


@pytest.mark.parametrize("damage, message", [
    ("misaligned", "train.de has 3,001 lines but"),
    ("no-val", "--val-data"),
    ("no-data", "recipe 'multi30k-de-en' trains on your parallel data: give --data PREFIX and --val-data"),
])
def test_bad_parallel_data_is_one_line_exit_2_and_no_run_directory(data, capsys, tmp_path, damage, message):
    train, val = data
    if damage == "misaligned":
        train = _slice(tmp_path, "train", 3000, extra=("", "an empty source"))
        (tmp_path / "train.en").write_text("just one line\n")
    data_flags = [] if damage == "no-data" else ["--data", str(train)]
    argv = ["train", "--recipe", "multi30k-de-en", *data_flags, "--out", str(tmp_path / "run"), "--no-progress", *TINY]
    status, lines, err = _run(capsys, *argv, *(["--val-data", str(val)] if damage != "no-val" else []))
    assert status == 2 and not lines and len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "run").exists()
