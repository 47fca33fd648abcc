"""Which dtype a run trains in: `TrainConfig.dtype` "auto" becomes bfloat16 only where bf16 matmuls
are natively fast, float32 everywhere else.

bf16 autocast pays only when the hardware multiplies bf16 faster than fp32: on a CPU that means AMX
tiles (Sapphire Rapids and later); AVX-512-BF16 alone converts and multiplies at about half the fp32
rate (issue 12: 193 vs 386 GFLOP/s on a 2-core Xeon without AMX). On CUDA it means a device with
native bf16 (compute capability 8.0+), not the emulation torch offers on older ones.
"""

from __future__ import annotations

import torch


def cpu_has_amx() -> bool:
    """True when this CPU has AMX tiles, the units that make bf16 matmuls faster than fp32."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def cuda_has_bf16(device: torch.device) -> bool:
    """True when the CUDA device computes in bf16 natively (not by emulation)."""
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_dtype(config_dtype: str, device: torch.device | str) -> tuple[str, str]:
    """"float32" | "bfloat16" | "auto" on `device` -> (dtype the run trains in, why, for the log)."""
    if config_dtype != "auto":
        return config_dtype, "as configured"
    device = torch.device(device)
    if device.type == "cpu":
        return ("bfloat16", "AMX on this CPU") if cpu_has_amx() else ("float32", "no AMX on this CPU")
    if device.type == "cuda":
        return (("bfloat16", "native bf16 on this CUDA device") if cuda_has_bf16(device)
                else ("float32", "no native bf16 on this CUDA device"))
    return "float32", f"no known fast bf16 on {device.type}"
