"""Configuration dataclasses with validated fields and named presets.

Every config in plainformer (models, training) derives from `Config`: a dataclass whose fields are
checked as soon as it is built, that round-trips through JSON, and that offers named presets through
`from_preset(name, **overrides)`. A field states its constraint where it is declared:

    n_layers: int = positive_int(6)
    dropout: float = probability(0.0)
    norm: str = one_of("layernorm", NORMS)
    capacity_factor: float | None = positive_number(None)  # None skips the check

The constraints are named as `_checks`' ranges, which the command line and the server use too
(`probability`: [0, 1); `positive_int`: an int >= 1; `positive_number`: a finite number > 0).

Each config says what its fields mean in `HELP`, one line a field: the command line's help for the flag
that sets it (`--n-layers`), which adds the choices of a `one_of` field and the value in force.

`Config` checks every field against its annotation first (bool, int, float, str, or None where the
annotation allows it; floats finite), so that a value of the wrong type, read from a file say, is
refused naming the field; then against its declared constraint; then runs `validate()`, which holds
only the rules that tie several fields together. Field names are shared across the project
(`n_layers`, `n_heads`, `n_kv_heads`, `d_model`, `d_ff`) and the CLI maps onto them one to one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar

from . import _checks

C = TypeVar("C", bound="Config")
T = TypeVar("T")

Check = Callable[[str, Any], object]  # check(field name, value) raises naming the field
_CHECKS = "checks"  # the key of a field's checks in its metadata


def checked(default: T, *checks: Check) -> T:
    """A field with this default whose value must pass each check(name, value), after its type check.
    None, where the annotation allows it, skips them."""
    return dataclasses.field(default=default, metadata={_CHECKS: checks})


def positive_int(default: T) -> T:
    return checked(default, _checks.check_positive_int)


def non_negative_int(default: T) -> T:
    return checked(default, _checks.check_non_negative_int)


def positive_number(default: T) -> T:
    """A finite number > 0."""
    return checked(default, _checks.check_positive_number)


def non_negative_number(default: T) -> T:
    """A finite number >= 0."""
    return checked(default, _checks.check_non_negative_number)


def probability(default: T) -> T:
    """A number in [0, 1) (a dropout rate, Adam's beta): `_checks.is_probability`."""
    return checked(default, _checks.check_probability)


def greater_than(default: T, bound: float) -> T:
    return checked(default, functools.partial(_checks.check_greater_than, bound=bound))


def one_of(default: T, choices: Iterable[str]) -> T:
    return checked(default, functools.partial(_checks.check_choice, choices=tuple(choices)))


@dataclasses.dataclass
class Config:
    """Base class: subclasses are dataclasses that declare their fields' constraints (`positive_int`,
    `probability`, `one_of`, ...), say what each field means in `HELP`, fill `PRESETS`, and override
    `validate` for rules across fields."""

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    HELP: ClassVar[Mapping[str, str]] = {}

    def __post_init__(self) -> None:
        config_cls: type = type(self)  # a class is hashable, whatever its instances' __hash__
        for name, scalar, checks in _field_checks(config_cls):
            value = getattr(self, name)
            if scalar is not None:
                check_field_type(name, value, *scalar)
            if value is not None:
                for check in checks:
                    check(name, value)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError/TypeError naming the offending fields: the rules that tie fields together
        (each field's own constraint is declared with it and checked before)."""

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
_IS_A: dict[type, Callable[[Any], bool]] = {
    bool: lambda value: isinstance(value, bool), int: _checks.is_int, float: _checks.is_number,
    str: lambda value: isinstance(value, str)}


@functools.cache
def _field_checks(cls: type) -> tuple[tuple[str, tuple[type, bool] | None, tuple[Check, ...]], ...]:
    """(field name, (scalar type, whether None is allowed) or None, declared checks) of every field;
    the scalar type is one of `_EXPECTED`'s types when the annotation is one (alone or `| None`)."""
    hints = typing.get_type_hints(cls)
    fields = []
    for field in dataclasses.fields(cls):
        kinds = typing.get_args(hints[field.name]) or (hints[field.name],)
        scalar = [k for k in kinds if k is not type(None)]
        kind = (scalar[0], type(None) in kinds) if len(scalar) == 1 and scalar[0] in _EXPECTED else None
        fields.append((field.name, kind, tuple(field.metadata.get(_CHECKS, ()))))
    return tuple(fields)


def field_checks(cls: type, name: str) -> tuple[Check, ...]:
    """The checks declared with field `name` of the config class `cls` (`positive_int(8)`'s, say)."""
    return next(checks for field, _, checks in _field_checks(cls) if field == name)


def field_choices(cls: type, name: str) -> tuple[str, ...] | None:
    """The values field `name` of the config class `cls` is declared `one_of`, else None."""
    return next((tuple(check.keywords["choices"]) for check in field_checks(cls, name)
                 if isinstance(check, functools.partial) and check.func is _checks.check_choice), None)


def check_field_type(name: str, value: Any, kind: type, optional: bool = False) -> None:
    """TypeError/ValueError unless `value` is a `kind` (bool, int, float, str; a float finite)."""
    if value is None and optional:
        return
    if not _IS_A[kind](value):
        raise TypeError(f"{name} must be {_EXPECTED[kind]}{' or None' if optional else ''}, "
                        f"got {type(value).__name__} {value!r}"[:200])
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
