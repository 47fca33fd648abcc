"""The memory this process may use, and refusing what would not fit it.

`available_memory` is the machine's MemAvailable (/proc/meminfo; else the free pages os.sysconf gives),
lowered to what RLIMIT_AS leaves this process when it is set; within `memory_limit(bytes)` it is the
limit given instead (the command line's --max-memory, for those who know better); `device_available`, an
accelerator's free memory, or that on the CPU. `check_memory` refuses
an estimate (a model's bytes, a training run's, a decoding's) beyond it, naming the size that is to
blame; `format_size` and `parse_size` write and read sizes (20.1 GB, 512MiB). `keep_freed_memory` asks
the C library's malloc to keep what the process frees for its next allocations.

What a model holds is counted by its class (models/family_model.py); what it needs beyond that to train,
evaluate or decode, each family's formula, is estimated in families/memory_estimates.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import ctypes
import dataclasses
import decimal
import math
import os
import re
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import torch

from . import _checks

try:
    import resource
except ImportError:  # not on Windows: no RLIMIT_AS to honour there
    resource = None  # type: ignore[assignment]

_limit: contextvars.ContextVar[int | None] = contextvars.ContextVar("plainformer_memory_limit", default=None)


class MemoryBudgetError(ValueError):
    """A config (or a batch, a beam) whose estimated bytes exceed the memory available."""


# ----------------------------------------------------------------------------- the memory available

def available_memory(held: int = 0) -> int:
    """The bytes this process may use: `memory_limit`'s when one is set, else the machine's MemAvailable,
    lowered to what RLIMIT_AS leaves (see the module docstring), plus `held`, bytes it holds already for
    what is estimated (a model loaded before its decoding is checked)."""
    limit = _limit.get()
    return limit if limit is not None else _machine_available() + held


@contextlib.contextmanager
def memory_limit(limit: int | None) -> Iterator[None]:
    """Within: `available_memory()` is `limit` bytes instead of the machine's (None: no change)."""
    if limit is None:
        yield
        return
    _checks.check_positive_int("limit", limit)
    token = _limit.set(limit)
    try:
        yield
    finally:
        _limit.reset(token)


def device_available(device: torch.device) -> int:
    """The bytes free on `device`: an accelerator's free memory (CUDA's), else `available_memory()`."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()


def _machine_available() -> int:
    free = _meminfo("/proc/meminfo", "MemAvailable")
    if free is None:
        free = _sysconf_bytes("SC_AVPHYS_PAGES")
    if resource is not None:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            left = max(0, soft - (_meminfo("/proc/self/status", "VmSize") or 0))
            free = left if free is None else min(free, left)
    return free if free is not None else 2**63  # nothing known: nothing refused


def _meminfo(path: str, key: str) -> int | None:
    """A `key:  N kB` line of a /proc file, in bytes; None where there is none."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sysconf_bytes(name: str) -> int | None:
    try:
        return os.sysconf(name) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# ----------------------------------------------------------------------------- refusing

def check_memory(what: str, estimate: Callable[..., int], *configs: Any, held: int = 0) -> int:
    """estimate(*configs) bytes, or a MemoryBudgetError when that exceeds `available_memory(held)`
    (`held`: bytes of the estimate allocated already, a model loaded).

    `what` says what needs them, with `{needed}` where the estimate goes ("training needs ~{needed}").
    The message names the size to blame: the int field of one of `configs` whose return to its default
    lowers the estimate most (n_layers=1000000, batch_size=100000000)."""
    needed = estimate(*configs)
    available = available_memory(held)
    if needed <= available:
        return needed
    blamed = _blamed_field(estimate, configs, needed)
    where = f"{blamed[0]}={blamed[1]}: " if blamed is not None else ""
    raise MemoryBudgetError(f"{where}{what.format(needed=format_size(needed))}, more than {available_phrase(held)}")


def available_phrase(held: int = 0) -> str:
    """"the 20.1 GB available", or "the 1.0 GB allowed" within `memory_limit`: what a refusal compares with."""
    allowed = "allowed" if _limit.get() is not None else "available"
    return f"the {format_size(available_memory(held))} {allowed}"


def _blamed_field(estimate: Callable[..., int], configs: tuple[Any, ...], needed: int) -> tuple[str, int] | None:
    """(name, value) of the int field whose default, put back, lowers the estimate (`needed`) most; None
    when none lowers it."""
    found: list[tuple[int, int, str, int]] = []
    for position, config in enumerate(configs):
        for field in dataclasses.fields(config):
            value, default = getattr(config, field.name), field.default
            if not _checks.is_int(value) or not (default is None or _checks.is_int(default) and value > default):
                continue
            trial = copy.copy(config)  # unchecked: a default may not fit the other fields' rules
            setattr(trial, field.name, default)
            try:
                lowered = estimate(*configs[:position], trial, *configs[position + 1:])
            except (TypeError, ValueError, ZeroDivisionError, RuntimeError):  # a None default where a number is
                # needed, or a model the default does not build with the other fields
                continue
            if lowered < needed:
                found.append((lowered, len(found), field.name, value))
    return min(found)[2:] if found else None


_UNITS = ("B", "kB", "MB", "GB", "TB", "PB", "EB")
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtpe])(i?)b?|b?)\s*", re.IGNORECASE)


def format_size(nbytes: int) -> str:
    """812 B, 20.1 GB, 3.2 TB (powers of 1000), 4.1e+27 B beyond exabytes."""
    if nbytes < 1000:
        return f"{nbytes} B"
    if nbytes >= 1000 ** len(_UNITS):  # exactly: an int of bytes may be beyond a float's range (--max-memory)
        return f"{decimal.Decimal(nbytes):.1e} B"
    exponent = min(int(math.log10(nbytes) // 3), len(_UNITS) - 1)
    if round(nbytes / 1000 ** exponent, 1) >= 1000 and exponent < len(_UNITS) - 1:
        exponent += 1  # 999,950 B rounds to 1000.0 kB: it is 1.0 MB
    value = nbytes / 1000 ** exponent
    return f"{value:.1f} {_UNITS[exponent]}" if round(value, 1) < 1000 else f"{nbytes:.1e} B"


def parse_size(text: str) -> int:
    """Bytes from a size: 64GB, 1.5 TB, 512MiB, 800k, 1000000 (a bare number is bytes; k, M, G, T, P, E are
    powers of 1000, Ki, Mi, ... of 1024; the B is optional and the case free). A ValueError otherwise.
    The arithmetic is exact: 400 nines are that many bytes, not a float's infinity (more digits than Python
    converts, 4,300, are a ValueError)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"expected a size such as 64GB or 512MiB, got {text!r}")
    number, prefix, binary = match.groups()
    power = 0 if prefix is None else "kmgtpe".index(prefix.lower()) + 1
    size = round(Fraction(number) * (1024 if binary else 1000) ** power)
    if size < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return size


# ----------------------------------------------------------------------------- the allocator

# glibc's mallopt parameters (malloc.h), and a trim threshold no heap reaches: never trim
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _NEVER = -1, -3, 2**31 - 1
#: Blocks of up to this many bytes come from the heap, not a mapping of their own (glibc's largest on 64 bits).
MMAP_THRESHOLD = 32 * 2**20


def keep_freed_memory() -> bool:
    """Keep the memory this process frees for its next allocations (glibc's malloc): -> whether it applied.

    torch's CPU tensors come from malloc. By default glibc maps a block of more than 128 KiB (more once
    such blocks were freed) afresh from the OS and returns the free top of its heaps to the OS, so each
    training step's activations of a few MiB touch new pages: 2,600 page faults a step for nanogpt-cpu in
    bf16 and 5,500 for the default, 7-15 ms of kernel time a step (a 2-core AMD EPYC). Blocks of up to
    MMAP_THRESHOLD bytes from the heap and no trimming take that to a few faults a step; the process holds
    on to its peak instead, as PyTorch's CUDA allocator does. A C library without mallopt (not glibc) is
    left as it is (False)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, TypeError):  # no mallopt, or no C library to open by None (Windows)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER))
