"""An optimizer's state in a checkpoint: its tensors as safetensors ("state.{param_index}.{name}") and
the rest as JSON; and, on load, every saved value checked against the optimizer it is loaded into.

The optimizers whose per-parameter state is known (Adam, AdamW, Muon, and an optimizer that steps
several of them through its `optimizers`, as training.optim.MuonWithAdamW does) must find that state
complete; for others only the generic checks apply.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import _checks
from .errors import CheckpointError, check_like

# The per-parameter state torch's Adam and AdamW keep; other optimizers get the generic checks only.
_ADAM_STATE = frozenset({"step", "exp_avg", "exp_avg_sq"})
# What each optimizer keeps per parameter once it has stepped (amsgrad's max_exp_avg_sq is allowed besides).
_KEPT_STATE = {torch.optim.Adam: _ADAM_STATE, torch.optim.AdamW: _ADAM_STATE,
               torch.optim.Muon: frozenset({"momentum_buffer"})}
# Param-group flags that choose how this optimizer runs here, not what it learned: kept, not loaded.
_IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def flatten_optimizer_state(state: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """{"state": {i: {name: value}}, "param_groups": [...]} -> tensors "state.{i}.{name}" + JSON rest."""
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalar_state": scalars}


def optimizer_state_dict(tensor_file: Path, meta_file: Path, tensors: Mapping[str, Tensor], meta: Any,
                         optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The saved state (`tensors` read from `tensor_file`, `meta` from `meta_file`) in
    `optimizer.state_dict()` layout, checked against `optimizer` (built over the same parameters)."""
    if not isinstance(meta, dict) or not isinstance(meta.get("param_groups"), list):
        raise CheckpointError(f"{meta_file} has no 'param_groups' list")
    groups, params = _param_groups(meta_file, meta["param_groups"], optimizer)
    state = _optimizer_state(tensor_file, meta_file, tensors, meta.get("scalar_state", {}), params,
                             _kept_state(optimizer))
    return {"state": state, "param_groups": groups}


def _param_groups(file: Path, saved: list, optimizer: torch.optim.Optimizer
                  ) -> tuple[list[dict[str, Any]], dict[int, Tensor]]:
    """The saved param groups checked against the optimizer's, each hyperparameter of the type the
    optimizer uses (JSON made tuples lists); and saved parameter id -> the parameter it stands for."""
    current = optimizer.param_groups
    sizes = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else None
             for g in saved]
    if sizes != [len(c["params"]) for c in current]:
        raise CheckpointError(f"{file} describes param groups of sizes {sizes} but the optimizer has "
                              f"{[len(c['params']) for c in current]}; build it over the same model")
    ids = [i for g in saved for i in g["params"]]
    if not all(map(_checks.is_int, ids)) or len(set(ids)) != len(ids):
        raise CheckpointError(f"{file}: the 'params' of the param groups must be distinct integers")
    groups = []
    for number, (group, ours) in enumerate(zip(saved, current, strict=True)):
        values = {"params": group["params"]}
        for key, value in ours.items():
            if key in _IMPLEMENTATION_FLAGS:
                values[key] = value
            elif key != "params":
                values[key] = _hyperparameter(f"{file}: param group {number}, {key!r}",
                                              group.get(key, value), value)
        groups.append(values)
    return groups, dict(zip(ids, (p for c in current for p in c["params"]), strict=True))


def _hyperparameter(where: str, saved: Any, ours: Any) -> Any:
    """`saved` converted to the type of `ours` (tuple for a list, a finite float for a number)."""
    def number(x: Any) -> bool:
        return _checks.is_number(x) and math.isfinite(x)

    if isinstance(ours, tuple) and isinstance(saved, (list, tuple)) and len(saved) == len(ours) \
            and all(map(number, saved)):
        return tuple(saved)
    if isinstance(ours, bool) or ours is None or isinstance(ours, str):
        ok = type(saved) is type(ours)
    else:
        ok = isinstance(ours, (int, float, Tensor)) and number(saved)
    if not ok:
        raise CheckpointError(f"{where} is {saved!r:.60}, expected a value like {ours!r:.60}")
    return saved


def _kept_state(optimizer: torch.optim.Optimizer) -> dict[int, tuple[str, frozenset[str]]]:
    """Parameter index (param_groups order) -> (optimizer name, the state it keeps per parameter), for
    the optimizers whose state is known: Adam, AdamW, Muon, also as the parts of one that steps several
    (training.optim.MuonWithAdamW, its `optimizers`)."""
    kept: dict[int, tuple[str, frozenset[str]]] = {}
    index = 0
    for part in getattr(optimizer, "optimizers", [optimizer]):
        keys = next((k for cls, k in _KEPT_STATE.items() if isinstance(part, cls)), None)
        for group in part.param_groups:
            for _ in group["params"]:
                if keys is not None:
                    kept[index] = (type(part).__name__, keys)
                index += 1
    return kept


def _optimizer_state(file: Path, meta_file: Path, tensors: Mapping[str, Tensor], scalar_state: Any,
                     params: Mapping[int, Tensor], kept: Mapping[int, tuple[str, frozenset[str]]]
                     ) -> dict[int, dict[str, Any]]:
    """{param id: {name: value}} from "state.{id}.{name}" tensors and the JSON scalars, each checked
    against its parameter: a `step` is a float scalar; every other tensor has the parameter's shape
    and dtype (torch's fused kernels read them unchecked); the state of a parameter in `kept` is complete."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        prefix, index, name = (key.split(".", 2) + ["", ""])[:3]
        if prefix != "state" or not index.isdigit() or int(index) not in params or not name:
            raise CheckpointError(f"{file} holds {key!r}, which is not 'state.{{i}}.{{name}}' for one of "
                                  f"the optimizer's {len(params)} parameters")
        where = f"{file}: {key}"
        if name == "step":
            if value.shape != () or not value.is_floating_point():
                raise CheckpointError(f"{where} must be a float scalar, got {value.dtype} of shape "
                                      f"{tuple(value.shape)}")
        else:
            check_like(where, value, params[int(index)], exact_dtype=True)
        state.setdefault(int(index), {})[name] = value
    if not isinstance(scalar_state, dict):
        raise CheckpointError(f"{meta_file}: 'scalar_state' must be an object")
    for index, scalars in scalar_state.items():
        if not index.isdigit() or int(index) not in params or not isinstance(scalars, dict) \
                or not all(isinstance(v, (int, float, bool)) or v is None for v in scalars.values()):
            raise CheckpointError(f"{meta_file}: 'scalar_state' entry {index!r} must map "
                                  "names to numbers for one of the optimizer's parameters")
        state.setdefault(int(index), {}).update(scalars)
    for number, values in state.items():
        if number in kept and set(values) - {"max_exp_avg_sq"} != kept[number][1]:
            name, keys = kept[number]
            raise CheckpointError(f"{file}: the state of parameter {number} holds {sorted(values)}; "
                                  f"{name} keeps {sorted(keys)}")
    return state
