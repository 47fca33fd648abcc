"""Running a module in evaluation mode for a while: dropout off, then its mode as it was."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """`module.eval()` inside the block; afterwards (also after an exception) train mode is restored
    if the module was training. Only the top module's flag is remembered, as `module.train(mode)` sets
    every submodule alike."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)
