"""Loss curves from a run's metrics.jsonl, drawn with matplotlib's Agg canvas.

The figure is built with `matplotlib.figure.Figure` rather than pyplot, so that drawing it neither
needs a display nor switches the backend of a notebook that imported plainformer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def plot_loss_curve(metrics_jsonl_path: str | os.PathLike, png_path: str | os.PathLike) -> Path:
    """Train and validation loss against step, learning rate on a twin axis; written atomically.

    Reads the lines {"step", "train_loss", "lr", ...} and {"step", "val_loss", ...} that the
    trainer appends. Raises ValueError naming the file when it holds no losses or a line is not JSON.
    """
    from matplotlib.figure import Figure

    metrics_jsonl_path, png_path = Path(metrics_jsonl_path), Path(png_path)
    series: dict[str, tuple[list[int], list[float]]] = {"train_loss": ([], []), "val_loss": ([], []),
                                                        "lr": ([], [])}
    for number, line in enumerate(metrics_jsonl_path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{metrics_jsonl_path} line {number} is not JSON: {e}") from None
        for key, (steps, values) in series.items():
            if record.get(key) is not None:
                steps.append(record["step"])
                values.append(record[key])
    if not series["train_loss"][0] and not series["val_loss"][0]:
        raise ValueError(f"{metrics_jsonl_path} holds no train_loss or val_loss to plot")

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    ax.plot(*series["train_loss"], label="train loss", color="tab:blue", linewidth=1)
    ax.plot(*series["val_loss"], label="val loss", color="tab:orange", marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    lines, labels = ax.get_legend_handles_labels()
    if series["lr"][0]:
        lr_ax = ax.twinx()
        lr_ax.plot(*series["lr"], label="learning rate", color="tab:gray", linestyle="--", linewidth=1)
        lr_ax.set_ylabel("learning rate")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        more_lines, more_labels = lr_ax.get_legend_handles_labels()
        lines, labels = lines + more_lines, labels + more_labels
    ax.legend(lines, labels, loc="upper right")

    png_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = png_path.with_name(f".{png_path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=120)
    os.replace(tmp, png_path)
    return png_path


def plot_confusion_matrix(matrix: list[list[int]], classes: list[str] | tuple[str, ...],
                          png_path: str | os.PathLike, title: str = "") -> Path:
    """The confusion matrix (rows: true class, columns: predicted), each cell shaded by its share of its
    row and labelled with its count; written atomically."""
    from matplotlib.figure import Figure

    png_path = Path(png_path)
    counts = [list(row) for row in matrix]
    if len(counts) != len(classes) or any(len(row) != len(classes) for row in counts):
        raise ValueError(f"matrix must be {len(classes)} x {len(classes)}, one row and column per class")
    shares = [[count / max(sum(row), 1) for count in row] for row in counts]
    size = min(3 + 0.5 * len(classes), 12)
    fig = Figure(figsize=(size + 1, size), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(shares, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, label="share of the true class")
    if len(classes) <= 30:  # beyond that the counts would not be legible
        for i, row in enumerate(counts):
            for j, count in enumerate(row):
                ax.text(j, i, f"{count:,}", ha="center", va="center",
                        color="white" if shares[i][j] > 0.5 else "black", fontsize=8)
    ax.set_xticks(range(len(classes)), labels=classes, rotation=45, ha="right")
    ax.set_yticks(range(len(classes)), labels=classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if title:
        ax.set_title(title)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = png_path.with_name(f".{png_path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=120)
    os.replace(tmp, png_path)
    return png_path
