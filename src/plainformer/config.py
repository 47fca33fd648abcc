"""Configuration dataclasses with validated fields and named presets.

Every config in plainformer (models, training) derives from `Config`: a dataclass whose fields are
checked in `validate()` as soon as it is built, that round-trips through JSON, and that offers named
presets through `from_preset(name, **overrides)`. Before `validate()`, every field is checked against
its annotation (bool, int, float, str, or None where the annotation allows it; floats finite), so
that a value of the wrong type, read from a file say, is refused naming the field. Field names are
shared across the project (`n_layers`, `n_heads`, `n_kv_heads`, `d_model`, `d_ff`) and the CLI maps
onto them one to one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

C = TypeVar("C", bound="Config")


@dataclasses.dataclass
class Config:
    """Base class: subclasses are dataclasses that fill `PRESETS` and override `validate`."""

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    def __post_init__(self) -> None:
        config_cls: type = type(self)  # a class is hashable, whatever its instances' __hash__
        for name, (kind, optional) in _scalar_fields(config_cls).items():
            check_field_type(name, getattr(self, name), kind, optional)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError/TypeError naming the offending field. Subclasses extend this."""

    @classmethod
    def preset_names(cls) -> list[str]:
        return sorted(cls.PRESETS)

    @classmethod
    def from_preset(cls: type[C], name: str, **overrides: Any) -> C:
        if name not in cls.PRESETS:
            raise ValueError(f"unknown {cls.__name__} preset {name!r}; "
                             f"choose one of {', '.join(cls.preset_names())}")
        return cls.from_dict({**cls.PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls: type[C], values: Mapping[str, Any]) -> C:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}; "
                             f"known fields: {', '.join(sorted(known))}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self: C, **changes: Any) -> C:
        """A copy with some fields changed, validated again."""
        return type(self).from_dict({**self.to_dict(), **changes})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls: type[C], text: str) -> C:
        return cls.from_dict(json.loads(text))


# What a value of each scalar field type must be; bool is no int and no float here.
_EXPECTED = {bool: "a bool", int: "an int", float: "a number", str: "a str"}


@functools.cache
def _scalar_fields(cls: type) -> dict[str, tuple[type, bool]]:
    """Field name -> (scalar type, whether None is allowed), for the fields annotated with one of
    `_EXPECTED`'s types (alone or `| None`)."""
    hints = typing.get_type_hints(cls)
    fields = {}
    for field in dataclasses.fields(cls):
        kinds = typing.get_args(hints[field.name]) or (hints[field.name],)
        scalar = [k for k in kinds if k is not type(None)]
        if len(scalar) == 1 and scalar[0] in _EXPECTED:
            fields[field.name] = (scalar[0], type(None) in kinds)
    return fields


def check_field_type(name: str, value: Any, kind: type, optional: bool = False) -> None:
    """TypeError/ValueError unless `value` is a `kind` (bool, int, float, str; a float finite)."""
    if value is None and optional:
        return
    accepted = (int, float) if kind is float else kind
    if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
        raise TypeError(f"{name} must be {_EXPECTED[kind]}{' or None' if optional else ''}, "
                        f"got {type(value).__name__} {value!r}"[:200])
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
