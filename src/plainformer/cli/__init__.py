"""The `plainformer` command line.

Every command ends by printing one JSON line of metrics on stdout; progress and logs go to stderr.
A mistake a user can make (a bad path, a bad value) prints one line `plainformer: error: ...` and
exits with status 2, without a traceback; Ctrl-C exits with 130.

Each model family registers its subcommands from its own module (`gpt`, `seq2seq`, `bert`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from .. import __version__
from ..config import Config
from ..training.trainer import TrainingInterrupted

Command = Callable[[argparse.Namespace], dict[str, Any]]


class UserError(Exception):
    """An error the user can fix; printed as one line, exit status 2."""


def emit_metrics(metrics: dict[str, Any]) -> None:
    """The command's last word: one JSON line on stdout."""
    sys.stdout.write(json.dumps(metrics, sort_keys=True) + "\n")
    sys.stdout.flush()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _option_type(annotation: Any) -> type:
    """The scalar type behind `int`, `float | None`, `str`, ..."""
    arguments = [a for a in typing.get_args(annotation) if a is not type(None)]
    return arguments[0] if arguments else annotation


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: type[Config], *,
                         skip: Iterable[str] = (), title: str | None = None) -> None:
    """One option per config field, `--n-layers` for `n_layers`, defaulting to "not given".

    The value then comes from the preset unless the option is given, so the CLI maps 1:1 onto the
    config. Booleans take `--bias/--no-bias`.
    """
    group = parser.add_argument_group(title or f"{config_cls.__name__} fields")
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        if field.name in skip:
            continue
        kind = _option_type(hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            group.add_argument(flag, dest=field.name, type=kind, default=None, metavar=kind.__name__.upper())


def config_overrides(args: argparse.Namespace, config_cls: type[Config]) -> dict[str, Any]:
    """The config fields given on the command line."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)
            if getattr(args, f.name, None) is not None}


def checkpoint_dir(path: Path) -> Path:
    """A checkpoint directory, or a run directory holding best/ (preferred) or last/."""
    for candidate in (path / "best", path / "last"):
        if candidate.is_dir():
            return candidate
    return path


def build_parser() -> argparse.ArgumentParser:
    from . import bert, gpt, prepare, seq2seq

    parser = argparse.ArgumentParser(
        prog="plainformer",
        description="Train, evaluate and sample Transformers built from first principles.")
    parser.add_argument("--version", action="version", version=f"plainformer {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (gpt, seq2seq, bert, prepare):
        module.register(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        metrics = args.run(args)
    except TrainingInterrupted as stop:
        log(f"plainformer: interrupted at step {stop.step}; checkpoint saved to {stop.checkpoint}; "
            "continue with the same command and --resume")
        emit_metrics({"interrupted": True, "step": stop.step, "checkpoint": str(stop.checkpoint)})
        return 130
    except KeyboardInterrupt:
        log("plainformer: interrupted")
        return 130
    except Exception as error:
        if not _is_user_error(error):
            raise
        log(f"plainformer: error: {error}")
        return 2
    emit_metrics(metrics)
    return 0


def _is_user_error(error: Exception) -> bool:
    """UserError and file errors always are; a ValueError/TypeError is when plainformer's own checks
    raised it (a bad value given by the user), not a library deep inside (a bug: keep the traceback)."""
    if isinstance(error, (UserError, OSError)):
        return True
    if not isinstance(error, (ValueError, TypeError)):
        return False
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and frame.tb_frame.f_globals.get("__name__", "").startswith("plainformer")
