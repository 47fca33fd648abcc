"""The linear layers of a model, and the one way a decoding-time transform swaps them."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, layer) for every `nn.Linear` of `model` (ours included), in module order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Every `nn.Linear` of `model` swapped for make(layer), in place (int8 and prepacked layers); -> model.

    A layer registered at several places is made once and swapped at each, so that it stays shared. A
    model that is itself an `nn.Linear` has no parent to swap it in: make(model) is returned instead."""
    if isinstance(model, nn.Linear):
        return make(model)
    places = [(name, module) for name, module in model.named_modules(remove_duplicate=False)
              if isinstance(module, nn.Linear)]
    made: dict[int, nn.Module] = {}
    for name, layer in places:
        if id(layer) not in made:
            made[id(layer)] = make(layer)
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, made[id(layer)])
    return model
