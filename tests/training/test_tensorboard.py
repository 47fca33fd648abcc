"""--tensorboard: every metrics.jsonl number read back from the event files; a clear error without the extra."""

from __future__ import annotations

import json
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from plainformer.cli import build_parser
from plainformer.training.tensorboard import EVENTS_DIR, TAGS
from tests.training.test_trainer import train


def _jsonl_scalars(out_dir) -> dict[str, list[tuple[int, float]]]:
    scalars: dict[str, list[tuple[int, float]]] = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for name, value in record.items():
            if name != "step":
                scalars.setdefault(TAGS.get(name, name), []).append((record["step"], value))
    return scalars


def test_event_files_hold_every_logged_scalar(tmp_path):
    train(tmp_path, tensorboard=True)
    events = EventAccumulator(str(tmp_path / EVENTS_DIR))
    events.Reload()
    expected = _jsonl_scalars(tmp_path)
    assert {"loss/train", "loss/val", "lr", "tokens_per_s"} <= set(expected)
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, points in expected.items():
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in logged] == [s for s, _ in points], tag
        assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for (_, a), (_, b) in zip(logged, points, strict=True)), tag


def test_off_by_default_writes_no_event_files(tmp_path):
    train(tmp_path)
    assert not (tmp_path / EVENTS_DIR).exists()


def test_a_missing_extra_is_a_clear_error_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"pip install 'plainformer\[tensorboard\]'"):
        train(tmp_path, tensorboard=True)
    assert not (tmp_path / "last").exists()


def test_every_train_command_takes_the_flag():
    parser = build_parser()
    assert parser.parse_args(["train", "--tensorboard"]).tensorboard is True
