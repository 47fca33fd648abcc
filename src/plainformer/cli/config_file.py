"""The `--config FILE` reader: a YAML or JSON file of flag values, each typed as its flag would parse it.

A key is a flag's name with `_` or `-` (`n_layers: 2` or `n-layers: 2`); a key given twice, in either
spelling or repeated within the file, is an error (YAML and JSON would keep the last silently), and so
is a key that no flag has. What each key may hold is given by the caller as the argparse keywords of
its flag (`type`, `choices`, `nargs`), so the file and the command line agree.

The file is bounded before it is parsed: at most MAX_BYTES (a recipe.yaml is about 2 kB), and YAML's
aliases (`*name`, which repeat a node without writing it again, so that a few lines can stand for billions
of values) are refused wherever they stand. A number is written as one: a quoted string is not taken for a
number (`dropout: '0.1'` is refused as `n_layers: abc` is), and YAML reads `1e-3` as the float it is, as
YAML 1.2 and JSON do (YAML 1.1 wants `1.0e-3`). A null is a key not given, but where the flag takes `none`
(an optional field's, `OrNone`): there it is None, the field set back to none, as in a run's recipe.yaml.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import check_field_type
from . import NUMBER_TYPES, OrNone, UserError, utf8_text

#: Each key a file may give -> the argparse keywords of its flag: `type` a class (bool, int, float,
#: str, Path: the value must be one) or a parser of text (argparse's `type`, given the value as text,
#: which checks a range too), `choices`, `nargs`.
Flags = Mapping[str, Mapping[str, Any]]

MAX_BYTES = 1 << 16  # PyYAML reads about 100 kB/s of a long list in pure Python: this keeps a refusal within a second


def read_config_file(path: Path, flags: Flags, command: str) -> dict[str, Any]:
    """The values of a YAML or JSON file of flags, keys normalised to field names (n-layers -> n_layers);
    `command` is the command whose --help lists the flags."""
    if not path.exists():
        raise UserError(f"config file not found: {path}")
    if not path.is_file():
        raise UserError(f"--config {path} is not a regular file (a YAML or JSON file of flags)")
    with open(path, "rb") as file:
        raw = file.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise UserError(f"{path} is larger than a config file of flags may be ({MAX_BYTES // 1024} KiB)")
    text = utf8_text(raw, str(path))
    if path.suffix == ".json":
        try:
            values = json.loads(text, object_pairs_hook=_unique_pairs)
        except RecursionError:
            raise UserError(f"{path} is not valid JSON: it nests too deeply to read") from None
        except ValueError as error:  # json.JSONDecodeError, or a key given twice
            raise UserError(f"{path} is not valid JSON: {error}") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            values = yaml.load(text, Loader=_unique_keys_loader())  # a SafeLoader
        except RecursionError:
            raise UserError(f"{path} is not valid YAML: it nests too deeply to read") from None
        except (yaml.YAMLError, ValueError) as error:  # ValueError: an integer of more digits than Python reads
            raise UserError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    else:
        raise UserError(f"--config must be a .yaml, .yml or .json file, got {path}")
    if not isinstance(values, dict):
        raise UserError(f"{path} must hold a mapping of flag names to values, got {type(values).__name__}")
    normalised = [str(key).replace("-", "_") for key in values]
    twice = _first_repeated(sorted(normalised))
    if twice is not None:
        raise UserError(f"{path} gives {twice} twice (as {twice} and {twice.replace('_', '-')}?)")
    values = dict(zip(normalised, values.values(), strict=True))
    for key in values:
        if key not in flags:
            close = difflib.get_close_matches(key, sorted(flags), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(f"unknown key {key!r} in {path}{hint}; the keys are the flags of "
                            f"`{command} --help`")
    return {key: _typed(key, value, path, flags[key]) for key, value in values.items()
            if value is not None or isinstance(flags[key].get("type"), OrNone)}


def _first_repeated(keys: list[Any]) -> Any:
    """The first of `keys` seen a second time, or None (by equality: a YAML key may be a list, unhashable)."""
    hashable: set[Any] = set()
    unhashable: list[Any] = []
    for key in keys:
        try:
            if key in hashable:
                return key
            hashable.add(key)
        except TypeError:
            if key in unhashable:
                return key
            unhashable.append(key)
    return None


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json.loads keeps the last of a repeated key)."""
    twice = _first_repeated([key for key, _ in pairs])
    if twice is not None:
        raise ValueError(f"the key {twice!r} is given twice")
    return dict(pairs)


def _unique_keys_loader() -> type:
    """yaml.SafeLoader refusing an alias and a key given twice in a mapping (it keeps the last one silently),
    and reading 1e-3 as a float."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(None, None, f"an alias (*{event.anchor}) repeats a node, which "
                                                  "a config file may not do; write the value out",
                                                  event.start_mark)
            return super().compose_node(parent, index)

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            twice = _first_repeated([self.construct_object(key, deep=deep) for key, _ in node.value])
            if twice is not None:
                raise yaml.constructor.ConstructorError(None, None, f"the key {twice!r} is given twice",
                                                        node.start_mark)
            return super().construct_mapping(node, deep=deep)

    UniqueKeys.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))
    return UniqueKeys


# The floats with an exponent that YAML 1.1's resolver leaves as strings: 1e-3, 2E5, 1.5e3.
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


def _typed(key: str, value: Any, path: Path, flag: Mapping[str, Any]) -> Any:
    """A file's value as the flag would parse it: paths from strings, each of the flag's type (a number
    written as one, not as a string), choices checked."""
    kind = flag.get("type")
    if isinstance(kind, OrNone):  # an optional field's: null is None, the field set back to none
        if value is None:
            return None
        kind = kind.kind
    if kind is not None and not isinstance(kind, type):  # a parser of text checks the range too
        if isinstance(value, str) and kind in NUMBER_TYPES:
            raise UserError(f"{key} in {path} must be a number, got the string {value!r}")
        try:
            return kind(str(value))
        except argparse.ArgumentTypeError as error:
            raise UserError(f"{key} in {path}: {error}") from None
    if isinstance(value, str) and kind in (int, float):
        raise UserError(f"{key} in {path} must be {kind.__name__}, got the string {value!r}")
    if isinstance(value, str) and kind is Path:
        value = Path(value)
    try:
        _check_type(f"{key} in {path}", value, kind, flag.get("nargs"))
    except (TypeError, ValueError) as error:
        raise UserError(str(error)) from None
    choices = flag.get("choices")
    if choices is not None and value not in choices:
        raise UserError(f"{key} in {path} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _check_type(name: str, value: Any, kind: type | None, nargs: Any) -> None:
    """`value` is what a flag of type `kind` parses to: a list of str for nargs="+", a path, a config
    field's scalar, else a str; `name` says where it comes from in the message."""
    if nargs == "+":
        if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
            raise TypeError(f"{name} must be a list of str, got {value!r}")
    elif kind is Path:
        if not isinstance(value, Path):
            raise TypeError(f"{name} must be a path (a str), got {value!r}")
    elif kind in (bool, int, float):
        check_field_type(name, value, kind)
    elif not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {value!r}")
