"""Tests for plainformer.training.plots: the loss-curve PNG and the confusion matrix."""

from __future__ import annotations

import json

import pytest

from plainformer.training.plots import plot_confusion_matrix, plot_loss_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_writes_a_png_of_train_and_val_loss_and_leaves_no_temp_file(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl",
                  [{"step": s, "train_loss": 3.0 / s, "lr": 1e-3 * s} for s in range(1, 11)]
                  + [{"step": 10, "val_loss": 0.5}])
    out = plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "plots" / "loss.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["loss.png"]


def test_validation_only_metrics_still_plot(tmp_path):
    write_metrics(tmp_path / "m.jsonl", [{"step": 0, "val_loss": 2.5}])
    assert plot_loss_curve(tmp_path / "m.jsonl", tmp_path / "loss.png").read_bytes()[:8] == PNG_MAGIC


def test_metrics_without_losses_or_with_a_broken_line_are_a_clear_error(tmp_path):
    write_metrics(tmp_path / "empty.jsonl", [{"step": 1, "lr": 0.1}])
    with pytest.raises(ValueError, match=r"empty\.jsonl holds no train_loss or val_loss"):
        plot_loss_curve(tmp_path / "empty.jsonl", tmp_path / "loss.png")
    (tmp_path / "broken.jsonl").write_text('{"step": 1, "train_loss": 2.0}\n{"step": 2, "tra')
    with pytest.raises(ValueError, match=r"broken\.jsonl line 2 is not JSON"):
        plot_loss_curve(tmp_path / "broken.jsonl", tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()


def test_a_confusion_matrix_is_drawn_as_a_png_of_its_size_and_leaves_no_temp_file(tmp_path):
    from PIL import Image

    out = plot_confusion_matrix([[5, 1, 0], [2, 7, 1], [0, 0, 4]], ["neg", "neu", "pos"], tmp_path / "c" / "m.png",
                                title="val")
    assert out.read_bytes()[:8] == PNG_MAGIC and sorted(p.name for p in out.parent.iterdir()) == ["m.png"]
    small = plot_confusion_matrix([[1, 0], [0, 1]], ["a", "b"], tmp_path / "small.png")
    assert Image.open(out).size[0] > Image.open(small).size[0]  # more classes, a larger picture


def test_a_confusion_matrix_of_another_shape_than_its_classes_is_refused(tmp_path):
    with pytest.raises(ValueError, match="matrix must be 2 x 2, one row and column per class"):
        plot_confusion_matrix([[1, 0, 0], [0, 1, 0]], ["a", "b"], tmp_path / "m.png")
