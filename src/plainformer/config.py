"""Configuration dataclasses with validated fields and named presets.

Every config in plainformer (models, training) derives from `Config`: a dataclass whose fields are
checked in `validate()` as soon as it is built, that round-trips through JSON, and that offers named
presets through `from_preset(name, **overrides)`. Field names are shared across the project
(`n_layers`, `n_heads`, `n_kv_heads`, `d_model`, `d_ff`) and the CLI maps onto them one to one.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

C = TypeVar("C", bound="Config")


@dataclasses.dataclass
class Config:
    """Base class: subclasses are dataclasses that fill `PRESETS` and override `validate`."""

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    def __post_init__(self) -> None:
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
