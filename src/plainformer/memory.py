"""The memory this process may use, and refusing what would not fit it.

`available_memory` is the machine's MemAvailable (/proc/meminfo; else the free pages os.sysconf gives),
lowered to what RLIMIT_AS leaves this process when it is set; within `memory_limit(bytes)` it is the
limit given instead (the command line's --max-memory, for those who know better); `device_available`, an
accelerator's free memory, or that on the CPU. `check_memory` refuses
an estimate (a model's bytes, a training run's, a decoding's) beyond it, naming the size that is to
blame; `format_size` and `parse_size` write and read sizes (20.1 GB, 512MiB). `keep_freed_memory` asks
the C library's malloc to keep what the process frees for its next allocations.

What a model holds is counted here too, from its class and config, before anything is allocated
(`footprint`, `model_bytes`): the class builds its model on the meta device (no memory), with each stack
of identical layers one layer deep (the class's `shallow`), and its tensors are counted, each once (a tied
head is the embedding), a stack's layer as many times as the stack is deep, so that a config of
n_layers=10**6 is counted, and refused, at once:

    bytes = P · s + buffers + N_tensors · 2 kB         s = the bytes of an element (4 in float32)

2 kB per tensor is what the Python objects of a tiny tensor and its module measured (about 2.7 kB), which
is what a 100,000-layer model of tiny widths mostly costs. Building briefly holds a little more: the
float64 tables the positional buffers are computed from, an output projection before it is tied. It sits
in this bottom layer because the models' constructors, a checkpoint's loader and Hugging Face's reader
refuse a model too large before they build it. What a model needs beyond what it holds, to train,
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
from collections.abc import Callable, Iterator, Mapping
from fractions import Fraction
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import _checks

try:
    import resource
except ImportError:  # not on Windows: no RLIMIT_AS to honour there
    resource = None  # type: ignore[assignment]

_limit: contextvars.ContextVar[int | None] = contextvars.ContextVar("plainformer_memory_limit", default=None)
_counting: contextvars.ContextVar[bool] = contextvars.ContextVar("plainformer_counting", default=False)


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


def machine_memory() -> int | None:
    """The machine's RAM and swap (MemTotal + SwapTotal; else its physical pages), None where unknown: what no
    process here can use more of, so no limit given in place of `available_memory` may pass it."""
    ram = _meminfo("/proc/meminfo", "MemTotal") or _sysconf_bytes("SC_PHYS_PAGES")
    return None if ram is None else ram + (_meminfo("/proc/meminfo", "SwapTotal") or 0)


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
            trial = unchecked(config, **{field.name: default})  # a default may not fit the other fields' rules
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


# ----------------------------------------------------------------------------- what a model holds

TENSOR_OVERHEAD = 2048  # bytes per tensor beyond its elements: the Python objects (see the docstring)


@dataclasses.dataclass
class Footprint:
    """What a model holds: its parameters (each counted once), those of them that are the 2-D weights of
    linear layers inside the blocks (what Muon trains), its tensors (parameters and buffers) and the
    bytes of its buffers."""

    parameters: int = 0
    block_matrices: int = 0
    tensors: int = 0
    buffer_bytes: int = 0


def block_matrices(model: nn.Module) -> list[torch.Tensor]:
    """The hidden matrices Muon trains: 2-D weights of nn.Linear modules that sit inside an
    nn.ModuleList (the blocks), never an embedding (so not a head tied to one)."""
    skip = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)  # and, later, the ones taken
            for p in m.parameters(recurse=False)}
    hidden = []
    for stack in (m for m in model.modules() if isinstance(m, nn.ModuleList)):
        for linear in (m for m in stack.modules() if isinstance(m, nn.Linear)):
            p = linear.weight
            if p.requires_grad and p.ndim == 2 and id(p) not in skip:
                skip.add(id(p))
                hidden.append(p)
    return hidden


def count(model: nn.Module, times: Mapping[str, int] | None = None) -> Footprint:
    """What `model` holds, each tensor once; the tensors of a submodule named in `times` ("blocks.0",
    at any depth: "layers.0" is "bert.layers.0" too) count `times[name]` times."""
    times = times or {}
    hidden = {id(p) for p in block_matrices(model)}
    found = Footprint()
    seen: set[int] = set()
    named: list[tuple[str, torch.Tensor, bool]] = [(name, t, False) for name, t in model.named_parameters()]
    named += [(name, t, True) for name, t in model.named_buffers()]
    for name, tensor, is_buffer in named:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        copies = next((n for key, n in times.items() if f".{key}." in f".{name}"), 1)
        found.tensors += copies
        if is_buffer:
            found.buffer_bytes += copies * tensor.numel() * tensor.element_size()
        else:
            found.parameters += copies * tensor.numel()
            found.block_matrices += copies * tensor.numel() if id(tensor) in hidden else 0
    return found


def unchecked(config: Any, **changes: Any) -> Any:
    """A copy of `config` with `changes`, not validated again (a shallow stack of a deep config's layers)."""
    changed = copy.copy(config)
    for name, value in changes.items():
        setattr(changed, name, value)
    return changed


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def footprint(model_class: Any, config: Any) -> Footprint:
    """What `model_class(config)` holds, counted on the meta device, its stacks one layer deep as
    `model_class.shallow(config)` gives them (a config, and how many times each of its layers counts).

    A vocabulary size of 0 (one the data decides, not known yet) is no model to build: what it holds is a
    polynomial of degree at most 2 in that size (quadratic with GPT's bigram table), so it is counted at
    three sizes a, 2a and 3a past every special id, f(0) = 3 f(a) - 3 f(2a) + f(3a)."""
    unknown = [f.name for f in dataclasses.fields(config)
               if f.name.endswith("vocab_size") and getattr(config, f.name) == 0]
    if unknown:
        ids = (getattr(config, f.name) for f in dataclasses.fields(config) if f.name.endswith("_id"))
        a = 1 + max((i for i in ids if _checks.is_int(i)), default=0)
        counted = [footprint(model_class, unchecked(config, **dict.fromkeys(unknown, k * a))) for k in (1, 2, 3)]
        one, two, three = map(dataclasses.astuple, counted)
        return Footprint(*(3 * x - 3 * y + z for x, y, z in zip(one, two, three, strict=True)))
    built, times = model_class.shallow(config)
    token = _counting.set(True)
    try:
        with torch.device("meta"), _NoNormalInit():
            model = model_class(built)
    finally:
        _counting.reset(token)
    return count(model, times)


class _NoNormalInit(TorchFunctionMode):
    """`nn.init.normal_` and `Tensor.normal_` as no-ops, for a build on the meta device, whose tensors hold no
    values to draw: torch's meta `normal_` is a Python decomposition whose first call imports torch._dynamo,
    over a second of a command's start (the other initialisers run natively; a model that computes a table at
    build, RoPE's or the sinusoids', still pays it for its arithmetic on meta tensors)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is nn.init.normal_ or func is torch.Tensor.normal_:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def counting() -> bool:
    """Whether this is `footprint`'s own build of a model, of a config its constructor checked already:
    a constructor checks nothing again then."""
    return _counting.get()


def model_bytes(model_class: Any, config: Any, dtype: torch.dtype = torch.float32) -> int:
    """The bytes of `model_class(config)` with its parameters in `dtype`: parameters, buffers (as built)
    and the per-tensor overhead."""
    f = footprint(model_class, config)
    return f.parameters * itemsize(dtype) + f.buffer_bytes + f.tensors * TENSOR_OVERHEAD


# ----------------------------------------------------------------------------- the allocator

# glibc's mallopt parameters (malloc.h), and a trim threshold no heap reaches: never trim
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _NEVER = -1, -3, 2**31 - 1
#: Blocks of up to this many bytes come from the heap, not a mapping of their own (glibc's largest on 64 bits).
MMAP_THRESHOLD = 32 * 2**20


def keep_freed_memory() -> bool:
    """Keep the memory this process frees for its next allocations (glibc's malloc): -> whether it applied.

    torch's CPU tensors come from malloc. By default glibc maps a block of more than 128 KiB (more once
    such blocks were freed) afresh from the OS and returns the free top of its heaps to the OS, so each
    training step's activations of a few MiB touch new pages: thousands of page faults a step, and their
    kernel time (measured: docs/performance.md, "Choices inside the code"). Blocks of up to
    MMAP_THRESHOLD bytes from the heap and no trimming take that to a few faults a step; the process holds
    on to its peak instead, as PyTorch's CUDA allocator does. A C library without mallopt (not glibc) is
    left as it is (False)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, TypeError):  # no mallopt, or no C library to open by None (Windows)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER))
