"""The one reader of JSON files from outside (checkpoints, Hugging Face directories, tokenizer files):
a file that is missing, not UTF-8, not JSON or not an object raises one error naming the file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_json(path: str | os.PathLike, *, error: type[Exception] = ValueError, what: str = "valid JSON") -> Any:
    """The value the JSON file `path` holds; `error("{path} is missing")` or `error("{path} is not {what}:
    {reason}")` when there is none."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as reason:
        raise error(f"{path} is not {what}: {reason}") from None
    except RecursionError:
        raise error(f"{path} is not {what}: it nests too deeply to read") from None


def read_json_object(path: str | os.PathLike, *, error: type[Exception] = ValueError,
                     what: str = "valid JSON") -> dict[str, Any]:
    """As `read_json`, for a file that must hold a JSON object."""
    value = read_json(path, error=error, what=what)
    if not isinstance(value, dict):
        raise error(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value
