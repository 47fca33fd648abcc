"""The scores of a classifier's predictions, from the confusion matrix C (C[i, j]: examples of class i
predicted as j; s = ΣC examples, t_k = Σ_j C[k, j] of class k, p_k = Σ_i C[i, k] predicted as k):

    accuracy = tr(C) / s
    macro-F1 = mean over the classes present (t_k + p_k > 0) of F1_k = 2 C[k, k] / (t_k + p_k)
    MCC      = (tr(C) · s − Σ_k p_k t_k) / sqrt((s² − Σ_k p_k²)(s² − Σ_k t_k²))      (Gorodkin 2004; 0 when
               either factor is 0: all predictions or all labels of one class)

MCC is Matthews' correlation for two classes and its generalisation to more; these are scikit-learn's
accuracy_score, f1_score(average="macro") and matthews_corrcoef.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def confusion_matrix(labels: Tensor, predictions: Tensor, n_classes: int) -> Tensor:
    """(n_classes, n_classes) int64 counts: row = the true class, column = the predicted one."""
    if labels.shape != predictions.shape or labels.ndim != 1:
        raise ValueError(f"labels and predictions must be two (N,) tensors, got shapes {tuple(labels.shape)} and "
                         f"{tuple(predictions.shape)}")
    pairs = labels.long() * n_classes + predictions.long()
    return torch.bincount(pairs, minlength=n_classes * n_classes).reshape(n_classes, n_classes)


def classification_scores(labels: Tensor, predictions: Tensor, n_classes: int) -> dict[str, Any]:
    """accuracy, macro_f1, mcc (floats) and confusion_matrix (a list of rows) of `predictions` against
    `labels`, (N,) class ids in [0, n_classes), N >= 1."""
    if labels.numel() == 0:
        raise ValueError("the scores need at least one example, got none")
    matrix = confusion_matrix(labels, predictions, n_classes).double()
    correct, total = matrix.trace(), matrix.sum()
    true, predicted = matrix.sum(dim=1), matrix.sum(dim=0)  # t_k, p_k
    present = (true + predicted) > 0
    f1 = 2 * matrix.diagonal()[present] / (true + predicted)[present]
    covariance = correct * total - (predicted * true).sum()
    spread = (total ** 2 - (predicted ** 2).sum()) * (total ** 2 - (true ** 2).sum())
    mcc = float(covariance / spread.sqrt()) if spread > 0 else 0.0
    return {"accuracy": float(correct / total), "macro_f1": float(f1.mean()), "mcc": mcc,
            "confusion_matrix": matrix.long().tolist()}

