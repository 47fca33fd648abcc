"""A classifier's scores against scikit-learn's: the confusion matrix, accuracy, macro-F1 and Matthews
correlation, for two classes and more, and where a class is never predicted or never seen."""

from __future__ import annotations

import pytest
import torch
from sklearn import metrics

from plainformer.training.classification import classification_scores, confusion_matrix


def _reference(labels: torch.Tensor, predictions: torch.Tensor, n_classes: int) -> dict:
    y, p = labels.numpy(), predictions.numpy()
    return {"accuracy": metrics.accuracy_score(y, p), "macro_f1": metrics.f1_score(y, p, average="macro"),
            "mcc": metrics.matthews_corrcoef(y, p),
            "confusion_matrix": metrics.confusion_matrix(y, p, labels=list(range(n_classes))).tolist()}


@pytest.mark.parametrize("n_classes, n, seed", [(2, 7, 0), (2, 500, 1), (3, 60, 2), (5, 1000, 3)])
def test_scores_equal_scikit_learns(n_classes, n, seed):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, n_classes, (n,), generator=generator)
    right = torch.rand(n, generator=generator) < 0.6  # better than chance
    predictions = torch.where(right, labels, torch.randint(0, n_classes, (n,), generator=generator))
    ours, theirs = classification_scores(labels, predictions, n_classes), _reference(labels, predictions, n_classes)
    assert ours["confusion_matrix"] == theirs["confusion_matrix"]
    for name in ("accuracy", "macro_f1", "mcc"):
        assert ours[name] == pytest.approx(theirs[name], abs=1e-12), name


@pytest.mark.filterwarnings("ignore:A single label was found")
@pytest.mark.parametrize("labels, predictions", [
    ([0, 0, 1, 1], [0, 0, 0, 0]),   # one class predicted: MCC 0, F1 of the other 0
    ([1, 1, 1], [1, 1, 1]),         # one class seen and predicted
    ([0, 2, 2, 0], [2, 0, 0, 2]),   # class 1 neither seen nor predicted: left out of macro-F1
])
def test_degenerate_predictions_score_as_scikit_learn_does(labels, predictions):
    labels, predictions = torch.tensor(labels), torch.tensor(predictions)
    ours, theirs = classification_scores(labels, predictions, 3), _reference(labels, predictions, 3)
    for name in ("accuracy", "macro_f1", "mcc"):
        assert ours[name] == pytest.approx(theirs[name], abs=1e-12), name


def test_rows_of_the_confusion_matrix_are_true_classes():
    matrix = confusion_matrix(torch.tensor([0, 0, 1]), torch.tensor([1, 1, 1]), 2)
    assert matrix.tolist() == [[0, 2], [0, 1]]


def test_no_example_or_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="at least one example"):
        classification_scores(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), 2)
    with pytest.raises(ValueError, match="two \\(N,\\) tensors"):
        confusion_matrix(torch.tensor([0, 1]), torch.tensor([0]), 2)
