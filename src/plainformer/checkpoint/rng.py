"""A process's random streams in a checkpoint: torch (CPU and CUDA), Python `random` and numpy, as uint8
tensors and JSON, so that a resumed run draws the numbers it would have drawn."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor


def capture_rng_state(cuda_devices: Sequence[int] | None = None) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This process's torch (CPU, and CUDA `cuda_devices`, default all once initialised), Python and
    numpy RNG states, as (uint8 tensors, JSON)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()) if cuda_devices is None else cuda_devices:
            tensors[f"torch_cuda_{i}"] = torch.cuda.get_rng_state(i)
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return tensors, {"python": [version, list(internal), gauss_next],
                     "numpy": [name, np.asarray(keys).tolist(), pos, has_gauss, cached_gaussian]}



def restore_rng_state(tensors: Mapping[str, Tensor], states: Mapping[str, Any]) -> None:
    """Set the RNGs to what `capture_rng_state` returned as (tensors, states); raises KeyError,
    TypeError, ValueError or RuntimeError when they are malformed."""
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = {int(name.rsplit("_", 1)[1]): t for name, t in tensors.items() if name.startswith("torch_cuda_")}
    for device, state in cuda.items():
        if torch.cuda.is_available() and device < torch.cuda.device_count():
            torch.cuda.set_rng_state(state, device)
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, pos, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
