"""The position-wise feed-forward sublayer (Vaswani et al. 2017, section 3.3).

    FFN(x) = act(x W_1 + b_1) W_2 + b_2,   act = ReLU (paper), GELU (BERT) or its tanh
                                            approximation "gelu_tanh" (GPT-2), or ReLU²
                                            "relu2" = max(0, x)² (Primer, So et al. 2021; Nemotron),
                                            or SiLU "silu" = x·σ(x), the swish of Marian's opus-mt models
    SwiGLU:  FFN(x) = (SiLU(x W_1) ⊙ x W_3) W_2   (Shazeer 2020)

applied to each position separately: (B, n, d_model) -> (B, n, d_ff) -> (B, n, d_model).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "relu2", "silu", "swiglu")


def check_feedforward_args(d_ff: int, activation: str) -> None:
    """`FeedForward`'s own arguments: d_model and dropout a layer checks with its attention's."""
    _checks.check_positive_int("d_ff", d_ff)
    _checks.check_choice("activation", activation, ACTIVATIONS)


class FeedForward(nn.Module):
    """Linear `W_1` (d_model -> d_ff), activation, dropout, Linear `W_2` (d_ff -> d_model).

    With activation="swiglu" a third projection `W_3` (d_model -> d_ff) gates the first.
    validate_args=False skips the checks of the arguments (see `MultiHeadAttention`).
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0, *,
                 bias: bool = True, validate_args: bool = True):
        super().__init__()
        if validate_args:
            _checks.check_positive_int("d_model", d_model)
            check_feedforward_args(d_ff, activation)
            _checks.check_probability("dropout", dropout)
        self.activation = activation
        self.W_1 = nn.Linear(d_model, d_ff, bias=bias)
        self.W_3 = nn.Linear(d_model, d_ff, bias=bias) if activation == "swiglu" else None
        self.W_2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, n, d_model) -> (B, n, d_model); not checked here, a hot path (the layers check x)."""
        hidden = self.W_1(x)  # (B, n, d_ff)
        if self.activation == "relu":
            hidden = F.relu(hidden)
        elif self.activation == "gelu":
            hidden = F.gelu(hidden)
        elif self.activation == "gelu_tanh":
            hidden = F.gelu(hidden, approximate="tanh")
        elif self.activation == "relu2":
            hidden = F.relu(hidden).square()
        elif self.activation == "silu":
            hidden = F.silu(hidden)
        else:
            assert self.W_3 is not None  # built for swiglu
            hidden = F.silu(hidden) * self.W_3(x)
        return self.W_2(self.dropout(hidden))
