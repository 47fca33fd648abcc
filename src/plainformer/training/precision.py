"""Which dtype a run trains in: `TrainConfig.dtype` "auto" becomes bfloat16 only where bf16 matmuls
are natively fast, float32 everywhere else.

bf16 autocast pays only when the hardware multiplies bf16 faster than fp32. On a CPU with AMX tiles
(Sapphire Rapids and later) it always does. Without AMX it depends on the CPU, so it is measured
(`cpu_bf16_speedup`, once per process, in a fraction of a second): AVX-512-BF16 ran at about half the fp32
rate on a Xeon but nearly twice it on a Zen 4 AMD EPYC, and an AVX2-only CPU emulates bf16 far slower than
fp32 (measured: docs/experiments.md, "The dtype"; docs/performance.md, "Choices inside the code"). bf16 is
taken where it measures at least MIN_BF16_SPEEDUP times fp32's rate. In a distributed launch rank 0
measures and every rank takes its measurement (`shared_bf16_speedup`, which the Trainer enters), so that
the replicas train alike and in the dtype one process would; a process of a launch without it takes
float32 (each would measure its own). On CUDA it means a device with native bf16 (compute capability
8.0+), not the emulation torch offers on older ones.

On a CPU it also takes matmuls wide enough to outweigh the casts autocast adds around each of them: a
model narrower than MIN_BF16_WIDTH (its `config.d_model`) trains in float32 even with AMX: on a Xeon with
AMX a bf16 step was slower than fp32's at d_model 64 and faster from 128 (measured: docs/performance.md,
"Choices inside the code").
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from collections.abc import Iterator

import torch
from torch import nn

from ..launch import current_launch

MIN_BF16_WIDTH = 128
#: Without AMX, bf16 autocast is taken where bf16 matmuls measure at least this many times the fp32 rate: the
#: casts it adds eat part of the gain (measured: docs/performance.md, "Choices inside the code").
MIN_BF16_SPEEDUP = 1.5

_shared_speedup: contextvars.ContextVar[float | None] = contextvars.ContextVar("plainformer_bf16_speedup",
                                                                               default=None)


def cpu_has_amx() -> bool:
    """True when this CPU has AMX tiles, the units that make bf16 matmuls faster than fp32."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


@functools.cache
def cpu_bf16_speedup() -> float:
    """bf16 / fp32 throughput of this CPU's 256 x 256 matmuls, measured once per process (256: small
    enough that an emulated bf16 multiplies it in milliseconds, not seconds)."""
    return matmul_rate(torch.bfloat16, size=256) / matmul_rate(torch.float32, size=256)


def bf16_measurement(device: torch.device | str) -> float | None:
    """What `native_bf16` measures on `device`: this CPU's `cpu_bf16_speedup()` where it has no AMX; None
    where nothing is measured (AMX, CUDA)."""
    return cpu_bf16_speedup() if torch.device(device).type == "cpu" and not cpu_has_amx() else None


@contextlib.contextmanager
def shared_bf16_speedup(speedup: float) -> Iterator[None]:
    """Within: a process of a distributed launch takes `speedup`, rank 0's `cpu_bf16_speedup()`, as this
    CPU's, where it would otherwise not measure (`native_bf16`)."""
    token = _shared_speedup.set(speedup)
    try:
        yield
    finally:
        _shared_speedup.reset(token)


def cuda_has_bf16(device: torch.device) -> bool:
    """True when the CUDA device computes in bf16 natively (not by emulation)."""
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=False)


def model_width(model: nn.Module) -> int | None:
    """The model's `config.d_model`, the inner size of most of its matmuls; None for a model without one."""
    return getattr(getattr(model, "config", None), "d_model", None)


def native_bf16(device: torch.device | str) -> tuple[bool, str]:
    """Whether `device` multiplies bf16 natively (faster than fp32), and why, for the log."""
    device = torch.device(device)
    if device.type == "cpu":
        if cpu_has_amx():
            return True, "AMX on this CPU"
        if current_launch().world_size > 1:  # each process would measure its own: they must train alike
            speedup, by = _shared_speedup.get(), " by rank 0"
            if speedup is None:
                return False, "no AMX on this CPU; bf16 is not measured in a distributed launch"
        else:
            speedup, by = cpu_bf16_speedup(), ""
        if speedup >= MIN_BF16_SPEEDUP:
            return True, f"no AMX, but bf16 matmuls measured {speedup:.1f}x fp32's on this CPU{by}"
        return False, f"no AMX on this CPU; bf16 matmuls measured {speedup:.2f}x fp32's{by}"
    if device.type == "cuda":
        return ((True, "native bf16 on this CUDA device") if cuda_has_bf16(device)
                else (False, "no native bf16 on this CUDA device"))
    return False, f"no known fast bf16 on {device.type}"


def resolve_dtype(config_dtype: str, device: torch.device | str, width: int | None = None) -> tuple[str, str]:
    """"float32" | "bfloat16" | "auto" on `device` for a model of `width` (None: unknown, taken as wide)
    -> (dtype the run trains in, why, for the log)."""
    if config_dtype != "auto":
        return config_dtype, "as configured"
    native, why = native_bf16(device)
    if not native:
        return "float32", why
    if torch.device(device).type == "cpu" and width is not None and width < MIN_BF16_WIDTH:
        return "float32", f"d_model {width} too narrow for bf16 to pay on a CPU"
    return "bfloat16", why


def matmul_rate(dtype: torch.dtype, device: torch.device | str = "cpu", size: int = 1024,
                seconds: float = 0.1) -> float:
    """The best throughput of (size x size) @ (size x size) matmuls in `dtype` on `device` over about
    `seconds` (at least 3 of them, after one untimed), FLOP/s."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)

    def timed() -> float:
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    timed()
    best, deadline, runs = float("inf"), time.perf_counter() + seconds, 0
    while runs < 3 or time.perf_counter() < deadline:
        best, runs = min(best, timed()), runs + 1
    return 2 * size**3 / best


def slow_bf16_warning(dtype: str, device: torch.device | str) -> str | None:
    """For a run that trains in bfloat16 where bf16 is not native: one line with the measured
    slowdown of its matmuls against float32 (an AVX2-only CPU emulates bf16 far slower: docs/experiments.md,
    "The dtype"); None otherwise."""
    native, why = native_bf16(device)
    if dtype != "bfloat16" or native:
        return None
    # 256: a slow bf16 multiplies 1024 x 1024 in seconds
    bf16, fp32 = (matmul_rate(kind, device, size=256) for kind in (torch.bfloat16, torch.float32))
    return (f"warning: bfloat16 is not native here ({why}): its matmuls ran at {bf16 / 1e9:.1f} GFLOP/s "
            f"against {fp32 / 1e9:.0f} in float32 ({fp32 / bf16:.1f}x slower); training goes on "
            "(--dtype float32 or auto trains in float32)")
