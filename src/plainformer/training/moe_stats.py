"""What a run shows of its Mixture-of-Experts layers (nn/moe.py) while it trains.

Per log window of optimizer steps, for a model with L MoE layers of E experts:

    load_l,i   = slots routed to expert i of layer l / all slots of layer l      (fractions, Σ_i = 1)
    violation  = max_l (max_i load_l,i − mean_i load_l,i) / mean_i load_l,i     (0 = perfectly balanced)
    aux_loss, z_loss = mean over the window's steps of mean_l L_aux, mean_l L_z (last micro-batch of a step)
    dropped_tokens   = routing slots over capacity in the window (only when a layer has a capacity)

`MoEStats.after_step()` runs once per optimizer step, after `optimizer.step()`: it adds the step's
loads (every micro-batch, counted by the layers) to the window and then applies the aux-loss-free
bias update of every layer, which also resets their per-step counters. Nothing here synchronises
with the device except `flush()`, once per log line. `plot_expert_load` draws the loads of a run's
metrics.jsonl over training.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..files.atomic import atomic_path
from ..nn.moe import mean_router_losses, moe_layers


class MoEStats:
    """Window statistics of a model's MoE layers; falsy (and a no-op) for a model without any."""

    def __init__(self, model: nn.Module):
        self.layers = moe_layers(model)
        self._reset()

    def __bool__(self) -> bool:
        return bool(self.layers)

    def _reset(self) -> None:
        self._steps = 0
        self._load: torch.Tensor | None = None  # (L, E) slots per expert, summed over the window
        self._aux: torch.Tensor | None = None
        self._z: torch.Tensor | None = None
        self._dropped = 0

    @torch.no_grad()
    def after_step(self) -> None:
        """Add this optimizer step to the window, then update every layer's balancing bias."""
        if not self.layers:
            return
        load = torch.stack([layer.step_load for layer in self.layers])  # (L, E)
        aux, z = mean_router_losses(self.layers)
        self._load = load if self._load is None else self._load + load
        self._aux = aux.detach() if self._aux is None else self._aux + aux.detach()
        self._z = z.detach() if self._z is None else self._z + z.detach()
        self._dropped += sum(layer.step_dropped for layer in self.layers)
        self._steps += 1
        for layer in self.layers:
            layer.update_bias()

    def flush(self) -> dict[str, Any]:
        """The window's metrics (see the module docstring) for a metrics.jsonl row; {} when empty."""
        if not self.layers or not self._steps:
            return {}
        assert self._load is not None and self._aux is not None and self._z is not None  # set by a step
        load = self._load / self._load.sum(dim=1, keepdim=True).clamp_min(1)  # (L, E)
        mean = load.mean(dim=1)
        violation = ((load.max(dim=1).values - mean) / mean).max()
        row: dict[str, Any] = {"aux_loss": (self._aux / self._steps).item(), "z_loss": (self._z / self._steps).item(),
                               "expert_load": load.tolist(), "max_violation": violation.item()}
        if any(layer.capacity_factor is not None for layer in self.layers):
            row["dropped_tokens"] = self._dropped
        self._reset()
        return row


def plot_expert_load(metrics_jsonl_path: str | os.PathLike, png_path: str | os.PathLike) -> Path | None:
    """Each expert's load (fraction of its layer's slots) against step, one panel per MoE layer, and
    the max violation; written atomically. None (and nothing written) when no row has `expert_load`."""
    from matplotlib.figure import Figure

    steps, loads, violations = [], [], []
    for line in Path(metrics_jsonl_path).read_text().splitlines():
        record = json.loads(line)
        if record.get("expert_load") is not None:
            steps.append(record["step"])
            loads.append(record["expert_load"])
            violations.append(record["max_violation"])
    if not steps:
        return None
    n_layers, n_experts = len(loads[0]), len(loads[0][0])
    fig = Figure(figsize=(7, 2.2 * (n_layers + 1)), layout="constrained")
    axes = fig.subplots(n_layers + 1, 1, sharex=True, squeeze=False)[:, 0]
    for layer, ax in enumerate(axes[:-1]):
        for expert in range(n_experts):
            ax.plot(steps, [load[layer][expert] for load in loads], linewidth=1, label=f"expert {expert}")
        ax.axhline(1 / n_experts, color="black", linestyle=":", linewidth=1)
        ax.set_ylabel(f"MoE layer {layer}\nload")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper right", fontsize="x-small", ncol=min(n_experts, 4))
    axes[-1].plot(steps, violations, color="tab:red", linewidth=1)
    axes[-1].set_ylabel("max violation")
    axes[-1].set_xlabel("step")
    axes[-1].grid(alpha=0.3)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    return png_path
