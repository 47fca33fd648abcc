"""Argument checks for the public boundary.

Every public function validates its inputs once, here, so that a user sees a `ValueError` or
`TypeError` naming the argument, what was received and what was expected, instead of a crash deep
inside torch. Nothing in this module knows about the Transformer; it only phrases errors.

It also holds the one vocabulary of ranges, each name one interval wherever it is used: the configs'
fields (config.py), the command line's argument types (cli/__init__.py) and the server's request fields
(serve/protocol.py) test a value with these predicates, and each phrases its own error (a ValueError, an
argparse error, an OpenAI 400 naming the field):

    is_positive_int          an int >= 1
    is_non_negative_int      an int >= 0
    is_seed                  an int in [0, 2**64)
    is_positive_number       a finite number > 0
    is_non_negative_number   a finite number >= 0
    is_probability           a number in [0, 1)   (a dropout rate, Adam's beta)
    is_fraction              a number in (0, 1)   (a held-out share of the data)
    is_mass                  a number in (0, 1]   (top-p's nucleus)

An int is no bool, and a number is an int or a float, no bool, here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # annotations only: typing.TypeIs arrives with Python 3.13
    from typing_extensions import TypeIs


def is_int(value: object) -> TypeIs[int]:
    """An int that is no bool: Python counts True as an int, no argument here does."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeIs[int | float]:
    """An int or a float that is no bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value: object) -> TypeIs[int | float]:
    """A number that is neither infinite nor nan."""
    return is_number(value) and math.isfinite(value)


#: The seeds of random generators: 64-bit unsigned integers.
SEED_RANGE = 2**64


def is_positive_int(value: object) -> TypeIs[int]:
    return is_int(value) and value >= 1


def is_non_negative_int(value: object) -> TypeIs[int]:
    return is_int(value) and value >= 0


def is_seed(value: object) -> TypeIs[int]:
    return is_int(value) and 0 <= value < SEED_RANGE


def is_positive_number(value: object) -> TypeIs[int | float]:
    return is_number(value) and 0 < value < math.inf


def is_non_negative_number(value: object) -> TypeIs[int | float]:
    return is_number(value) and 0 <= value < math.inf


def is_probability(value: object) -> TypeIs[int | float]:
    """In [0, 1)."""
    return is_number(value) and 0 <= value < 1


def is_fraction(value: object) -> TypeIs[int | float]:
    """In (0, 1)."""
    return is_number(value) and 0 < value < 1


def is_mass(value: object) -> TypeIs[int | float]:
    """In (0, 1]."""
    return is_number(value) and 0 < value <= 1


def check_int(name: str, value: object) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def check_positive_int(name: str, value: object) -> int:
    number = check_int(name, value)
    if not is_positive_int(number):
        raise ValueError(f"{name} must be a positive integer, got {number}")
    return number


def check_non_negative_int(name: str, value: object) -> int:
    """A count or an index, >= 0; anything else, a float or a bool too, is a ValueError."""
    if not is_non_negative_int(value):
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def check_probability(name: str, value: float) -> float:
    if not is_number(value):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not is_probability(value):
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)


def check_positive_number(name: str, value: object) -> float:
    if not is_number(value):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not is_positive_number(value):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def check_non_negative_number(name: str, value: object) -> float:
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not is_non_negative_number(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_greater_than(name: str, value: float, bound: float) -> float:
    """A number above `bound` (a number already: checked by type, as a config field is)."""
    if not value > bound:
        raise ValueError(f"{name} must be > {bound}, got {value}")
    return value


def check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_divisible(name: str, value: int, divisor_name: str, divisor: int) -> None:
    if value % divisor != 0:
        raise ValueError(f"{name} ({value}) must be divisible by {divisor_name} ({divisor})")


def check_type(name: str, value: object, kind: type) -> None:
    """`value` is a `kind` (a model's config, say)."""
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")


def check_tensor(name: str, x: object, *, ndim: int | Sequence[int] | None = None,
                 shape_doc: str = "") -> Tensor:
    """`x` is a tensor whose rank is `ndim` (or one of several ranks); `shape_doc` names the axes."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    ranks = (ndim,) if isinstance(ndim, int) else ndim
    if ranks is not None and x.dim() not in ranks:
        expected = " or ".join(str(r) for r in ranks)
        doc = f" {shape_doc}" if shape_doc else ""
        raise ValueError(f"{name} must have {expected} dimensions{doc}, got shape {tuple(x.shape)}")
    return x


def check_min_rank(name: str, x: object, min_ndim: int, shape_doc: str) -> Tensor:
    tensor = check_tensor(name, x)
    if tensor.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions {shape_doc}, "
                         f"got shape {tuple(tensor.shape)}")
    return tensor


def check_floating(name: str, x: Tensor) -> Tensor:
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def check_same_dtype_device(**tensors: Tensor) -> None:
    """All tensors share one dtype and one device (q, k and v, say)."""
    names = list(tensors)
    first = tensors[names[0]]
    for name in names[1:]:
        other = tensors[name]
        if other.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {other.dtype} but {names[0]} has {first.dtype}; "
                            "they must match")
    check_same_device(**tensors)


def check_same_device(**tensors: Tensor) -> None:
    """All tensors live on one device."""
    names = list(tensors)
    first = tensors[names[0]]
    for name in names[1:]:
        other = tensors[name]
        if other.device != first.device:
            raise ValueError(f"{name} is on {other.device} but {names[0]} is on {first.device}; "
                             "they must be on the same device")


def check_same_shape(name: str, x: object, like_name: str, like: Tensor) -> Tensor:
    """x is a tensor of like's shape (targets of their inputs, say)."""
    tensor = check_tensor(name, x)
    if tensor.shape != like.shape:
        raise ValueError(f"{name} must have the shape of {like_name} {tuple(like.shape)}, "
                         f"got {tuple(tensor.shape)}")
    return tensor


def check_dtype(name: str, x: Tensor, dtype: torch.dtype, what: str) -> Tensor:
    """x has `dtype`; `what` says what it holds and as which type ("token ids as torch.long")."""
    if x.dtype != dtype:
        raise TypeError(f"{name} must hold {what}, got {x.dtype}")
    return x


def check_last_dim(name: str, x: Tensor, size: int, what: str) -> None:
    if x.shape[-1] != size:
        raise ValueError(f"{name} must have last dimension {what} = {size}, "
                         f"got shape {tuple(x.shape)}")


def check_broadcastable(name: str, x: Tensor, target: Sequence[int], target_doc: str) -> None:
    try:
        torch.broadcast_shapes(tuple(x.shape), tuple(target))
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(x.shape)} is not broadcastable to "
                         f"{target_doc} = {tuple(target)}") from None


def check_token_id_tensor(name: str, idx: object, *, ndim: int = 2, shape_doc: str = "(B, n)") -> Tensor:
    """An integer tensor of rank `ndim`: metadata only, so it costs no device-to-host copy."""
    idx = check_tensor(name, idx, ndim=ndim, shape_doc=shape_doc)
    if idx.dtype not in (torch.long, torch.int, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"{name} must hold integer token ids, got dtype {idx.dtype}")
    return idx


def check_token_ids(name: str, idx: object, vocab_size: int, *, ndim: int = 2,
                    shape_doc: str = "(B, n)") -> Tensor:
    """Integer token ids of rank `ndim`, each in [0, vocab_size).

    Reading the range copies it to the host (a sync on an accelerator): call this where ids enter
    from outside (a prompt, a file), once, not in a forward; see `lookup_token_ids`.
    """
    idx = check_token_id_tensor(name, idx, ndim=ndim, shape_doc=shape_doc)
    if idx.numel() == 0:
        return idx
    low, high = torch.aminmax(idx)
    if bool((low < 0) | (high >= vocab_size)):  # one sync; the message may take more
        raise ValueError(f"{name} holds ids in [{int(idx.min())}, {int(idx.max())}] but must be in "
                         f"[0, {vocab_size}) (vocab_size={vocab_size})")
    return idx


def lookup_token_ids(name: str, idx: Tensor, vocab_size: int, lookup: Callable[[Tensor], Tensor]) -> Tensor:
    """lookup(idx) (an embedding, a loss over class ids), with `check_token_ids`' message for bad ids.

    Nothing is read from idx up front, so valid ids cost no device-to-host copy: an id outside
    [0, vocab_size) makes the CPU lookup raise IndexError, which is explained here. (On CUDA a bad id
    is a device-side assert instead; there ids are checked where they enter: tokenizers, the CLI,
    the prompt of `generate`.)
    """
    try:
        return lookup(idx)
    except IndexError:
        check_token_ids(name, idx, vocab_size, ndim=idx.dim(), shape_doc="")
        raise


def check_key_padding_mask(name: str, mask: object, batch: int, m: int, device: torch.device) -> Tensor:
    """A boolean (B, m) mask, True = real token, on `device`."""
    mask = check_tensor(name, mask, ndim=2, shape_doc="(B, m)")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be boolean (True = real token), got dtype {mask.dtype}")
    if tuple(mask.shape) != (batch, m):
        raise ValueError(f"{name} must have shape (B, m) = {(batch, m)}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the inputs are on {device}")
    return mask


def check_index(name: str, value: object, size: int, size_name: str) -> int:
    """An int in [0, size): a special token id, say."""
    index = check_int(name, value)
    if not 0 <= index < size:
        raise ValueError(f"{name} must be in [0, {size_name}={size}), got {index}")
    return index


def check_max_len(name: str, length: int, max_len: int, max_name: str = "max_len") -> None:
    if length > max_len:
        raise ValueError(f"{name} has length {length}, longer than {max_name}={max_len}")


def check_context(name: str, length: int, cached: int, size: int, size_name: str = "block_size") -> None:
    """`length` new positions after `cached` ones fit a context of `size` positions."""
    if cached + length > size:
        raise ValueError(f"{name} has {length} positions after {cached} cached ones, more than "
                         f"{size_name}={size}")


def check_one_per_layer(name: str, items: Sequence[object], n_layers: int, what: str) -> None:
    if len(items) != n_layers:
        raise ValueError(f"{name} must hold one {what} per layer ({n_layers}), got {len(items)}")


def check_positions(name: str, offset: int, length: int, max_len: int) -> None:
    """Positions offset .. offset+length-1 of `name` fit a table of max_len positions."""
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    check_max_len(f"{name} (offset included)", offset + length, max_len)
