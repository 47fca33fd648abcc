"""The `plainformer` command line: verbs at the top level, the model family taken from the recipe
(`--recipe`) or from the checkpoint (`--ckpt`).

`train` and `eval` end by printing one JSON line of metrics on stdout. Commands whose stdout is their
product (`sample`, `translate`, `embed`, `search`) print only that product there, and their metrics
as one JSON line on stderr, or as the last line of stdout with `--json`. Progress and logs go to
stderr. A mistake a user can make (a bad path, a bad value) prints one line `plainformer: error: ...`
and exits with status 2, without a traceback; Ctrl-C exits with 130. The command (`run`) ends without
the interpreter's teardown, which would spend a second or more freeing torch's objects one by one.

Each module of `COMMAND_MODULES` registers its commands through `register(subcommands)`; a new
command is a new module listed there.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import importlib
import json
import os
import sys
import threading
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from .. import _checks, families
from .._version import __version__
from ..config import Config, field_checks, field_choices
from ..errors import UserError
from ..families.family import Family, run_or_checkpoint_holding
from ..launch import is_main_process, launch_from_env
from ..log import log
from ..memory import MemoryBudgetError, format_size, keep_freed_memory, machine_memory, memory_limit, parse_size
from ..models.family_model import FamilyModel
from ..training.distributed import CollectiveTimeout, RankLost, run_torchrun
from ..training.trainer import TrainingInterrupted

COMMAND_MODULES = ("train", "eval", "sample", "translate", "classify", "embed", "search", "export", "attention",
                   "prepare", "average", "serve")


def emit_metrics(metrics: dict[str, Any], stream: typing.TextIO | None = None) -> None:
    """The command's last word: one JSON line, on stdout unless `stream` says otherwise (rank 0 only
    under torchrun)."""
    if not is_main_process():
        return
    stream = stream or sys.stdout
    stream.write(json.dumps(metrics, sort_keys=True) + "\n")
    stream.flush()


def add_product_arguments(parser: argparse.ArgumentParser) -> None:
    """For commands whose stdout is their product: metrics go to stderr unless --json."""
    parser.add_argument("--json", action="store_true",
                        help="end stdout with one JSON line of metrics (default: metrics on stderr)")
    parser.set_defaults(product=True)


def add_threads_argument(parser: argparse.ArgumentParser, default_doc: str = "torch's") -> None:
    parser.add_argument("--threads", type=positive_int, metavar="N",
                        help=f"torch.set_num_threads (default: {default_doc})")


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if not _checks.is_int(threads) or threads <= 0:
            raise UserError(f"--threads must be a positive integer, got {threads}")
        torch.set_num_threads(threads)


INFERENCE_DTYPES = ("float32", "bfloat16")
DTYPE_HELP = "precision to compute in: float32 or bfloat16"


QUANTIZE_HELP = ("int8: weight-only int8 (one fp32 scale per output row) on the fastest kernel this CPU has "
                 "(inference/quantize.py); said on stderr when none beats fp32")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=INFERENCE_DTYPES, default="float32",
                        help=f"{DTYPE_HELP} (default: %(default)s)")


def _checked(kind: Callable[[str], Any], expected: str, accept: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse type: a `kind` parsed from the text and accepted by `accept` (one of `_checks`' ranges,
    which refuse nan and inf); otherwise argparse's one-line error naming the option."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


# The argument types, named as `_checks`' ranges.
positive_int = _checked(int, "a positive integer", _checks.is_positive_int)
non_negative_int = _checked(int, "an integer >= 0", _checks.is_non_negative_int)
seed_int = _checked(int, "a seed, an integer in [0, 2**64)", _checks.is_seed)
non_negative_number = _checked(float, "a finite number >= 0", _checks.is_non_negative_number)
positive_number = _checked(float, "a finite number > 0", _checks.is_positive_number)
probability = _checked(float, "a number in [0, 1)", _checks.is_probability)
fraction = _checked(float, "a number in (0, 1)", _checks.is_fraction)
mass = _checked(float, "a probability in (0, 1]", _checks.is_mass)
memory_size = _checked(parse_size, "a size such as 64GB or 512MiB", _checks.is_positive_int)
#: The types above that parse a number: a config file gives it as a number, never as a string.
NUMBER_TYPES = frozenset({positive_int, non_negative_int, seed_int, non_negative_number, positive_number, probability,
                          fraction, mass})


#: The argument type of a config field declared with each of `_checks`' checks: the flag refuses, as
#: argparse's one-line error, what the field would.
_RANGE_TYPES: dict[Callable[..., object], Callable[[str], Any]] = {
    _checks.check_positive_int: positive_int, _checks.check_non_negative_int: non_negative_int,
    _checks.check_positive_number: positive_number, _checks.check_non_negative_number: non_negative_number,
    _checks.check_probability: probability}


def ranged_field_type(config_cls: type[Config], name: str) -> Callable[[str], Any]:
    """The argparse type of field `name` of `config_cls`: that of its declared range (`_RANGE_TYPES`)."""
    return next(_RANGE_TYPES[check] for check in field_checks(config_cls, name) if check in _RANGE_TYPES)


def add_max_memory_argument(parser: argparse.ArgumentParser) -> None:
    """--max-memory SIZE: the bytes the command may use, in place of the machine's available memory
    (families/memory_estimates.py), which every size is checked against before memory is spent."""
    parser.add_argument("--max-memory", type=_max_memory, metavar="SIZE", help=(
        "the memory the command may use, e.g. 64GB (default: what is available: RAM, RLIMIT_AS); what is "
        "estimated to need more is refused before memory is spent"))


def _max_memory(text: str) -> int:
    """A size no larger than the machine's RAM and swap: a limit past them would let through what no process here
    can hold (and 10**23 TB switched the check off)."""
    size = memory_size(text)
    machine = machine_memory()
    if machine is not None and size > machine:
        raise argparse.ArgumentTypeError(f"{text} is more than this machine has: {format_size(machine)} of RAM and "
                                         "swap")
    return size


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, shorter: `--[no-]bias` for a flag and its negation, a metavar once after all of a flag's
    names (`--recipe, --preset NAME`), the help of a flag up to 24 characters long beside it."""

    def __init__(self, prog: str, max_help_position: int = 28, **kwargs: Any):
        super().__init__(prog, max_help_position=max_help_position, **kwargs)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        if isinstance(action, argparse.BooleanOptionalAction):
            return action.option_strings[0].replace("--", "--[no-]", 1)
        names = ", ".join(action.option_strings)
        if action.nargs == 0:
            return names
        return f"{names} {self._format_args(action, self._get_default_metavar_for_optional(action))}"


class _Parser(argparse.ArgumentParser):
    """argparse's mistakes as one line `plainformer: error: ...`, like every other user error.

    A verb whose flags depend on one of them (`train`'s on the recipe) gives `build`: each parse, --help
    included, is then that of the parser `build` makes for the arguments at hand."""

    build: Callable[[list[str]], argparse.ArgumentParser] | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **{"formatter_class": HelpFormatter, **kwargs})

    def error(self, message: str) -> typing.NoReturn:
        raise UserError(f"{message} (see `{self.prog} --help`)")

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> Any:
        """As argparse's, but arguments left over are an error of this parser, so that a command's
        stray argument points to that command's --help (argparse reports them at the top)."""
        if self.build is not None:
            args = list(sys.argv[1:] if args is None else args)
            return self.build(args).parse_known_args(args, namespace)
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def format_help(self) -> str:
        return self.build([]).format_help() if self.build is not None else super().format_help()


def utf8_text(raw: bytes, what: str) -> str:
    """`raw` decoded as UTF-8 (a leading BOM dropped), or a UserError naming `what` and the first bad byte."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise UserError(f"{what} is not UTF-8 text (byte offset {error.start})") from None


CKPT_HELP = "checkpoint directory, run directory (its best/, else last/) or Hugging Face directory"


def load_any(path: Path) -> tuple[FamilyModel, Family]:
    """The model (with `.tokenizer`) of a Hugging Face directory or of a plainformer checkpoint or run,
    and its family: what `export` and `attention` take as --ckpt."""
    if not path.exists():
        raise UserError(f"--ckpt {path} does not exist")
    model = families.load_model(path)
    return model, families.get(model.family)


def check_output_path(flag: str, path: Path) -> None:
    """A UserError when `path`, a file or directory a command is to write, is or lies in a run or checkpoint
    directory (`--out RUN/best` would overwrite the checkpoint's own files)."""
    holder = run_or_checkpoint_holding(path)
    if holder is not None:
        raise UserError(f"{flag} {path} is inside the run or checkpoint directory {holder}, whose files it could "
                        "replace; write it outside that directory")


def stdin_lines() -> list[str]:
    """The lines of standard input, without their line ends: the input of `translate` and `embed`."""
    return utf8_text(sys.stdin.buffer.read(), "standard input").splitlines()


def _option_type(annotation: Any) -> type:
    """The scalar type behind `int`, `float | None`, `str`, ..."""
    arguments = [a for a in typing.get_args(annotation) if a is not type(None)]
    return arguments[0] if arguments else annotation


def _annotation(config_cls: type[Config], name: str) -> Any:
    """The type of field `name` of `config_cls` (typing's hints, resolved once per class)."""
    cls: type = config_cls  # a class is hashable, whatever its instances' __hash__
    return _type_hints(cls)[name]


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_type(config_cls: type[Config], name: str) -> type:
    return _option_type(_annotation(config_cls, name))


@dataclasses.dataclass(frozen=True)
class OrNone:
    """The argparse type of an optional config field: `none` is None, the field set back to none whatever the
    recipe's value; any other text a `kind`."""

    kind: type

    @property
    def __name__(self) -> str:  # argparse's "invalid int or none value: 'x'"
        return f"{self.kind.__name__} or none"

    def __call__(self, text: str) -> Any:
        return None if text.lower() == "none" else self.kind(text)


#: The metavar of a config field's flag, by its scalar type.
_METAVARS = {int: "N", float: "X", str: "NAME"}


def config_flag(config_cls: type[Config], name: str) -> dict[str, Any]:
    """The argparse keywords (all but help) of the flag of field `name` of `config_cls`, `--n-layers` for
    `n_layers`: a bool is `--bias/--no-bias`, an optional field takes `none` too (`OrNone`), a `one_of` field
    its choices. The value is checked by the config when it is built; the CLI maps 1:1 onto the fields."""
    kind = field_type(config_cls, name)
    if kind is bool:
        return dict(action=argparse.BooleanOptionalAction)
    optional = type(None) in typing.get_args(_annotation(config_cls, name))
    flag: dict[str, Any] = dict(type=OrNone(kind) if optional else kind, metavar=_METAVARS[kind])
    choices = field_choices(config_cls, name)
    if choices is not None:
        flag["choices"] = choices
    return flag


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="plainformer",
        description="Train, evaluate and sample Transformers built from first principles.")
    parser.add_argument("--version", action="version", version=f"plainformer {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except UserError as error:
        log(f"plainformer: error: {error}")
        return 2
    if not getattr(args, "run", None):
        parser.print_help(sys.stderr)
        return 2
    if getattr(args, "nproc", None) is not None and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return run_torchrun(args.nproc, _without_nproc(argv))
    keep_freed_memory()  # the steps' tensors reuse the pages of the step before (memory.py)
    try:
        with memory_limit(getattr(args, "max_memory", None)):
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
        line = f"plainformer: error: {error}{_memory_hint(args, error)}"
        if isinstance(error, (RankLost, CollectiveTimeout)) and error.reporting:  # rank 0 may be the rank lost
            print(line, file=sys.stderr, flush=True)
        else:
            log(line)
        return 2
    product = getattr(args, "product", False)
    emit_metrics(metrics, sys.stderr if product and not args.json else sys.stdout)
    return 0


def run() -> NoReturn:
    """The `plainformer` command and `python -m plainformer`: `main`, then its exit status.

    The exit skips Python's teardown of the interpreter, which frees the objects of every module one by one,
    torch's most of all, for a second or more after each command (measured: docs/performance.md, "Choices
    inside the code"), where the kernel takes back a process's memory at once. What an exit owes still
    happens, in Python's order: threads that are not daemons finish (while one runs, the exit is Python's
    own), the functions registered with `atexit` run (logging's flush, finalizers, temporary directories),
    the standard streams are flushed (where that fails, Python's exit reports it). An exception that leaves `main`
    takes Python's exit too, and so does a rank of a torchrun launch: when one rank fails, the launcher
    stops the others, and rank 0, the one that prints the error, must not be outrun by a rank that exits
    faster."""
    status = main()
    threads_running = any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()
                          if thread is not threading.main_thread())
    if threads_running or launch_from_env().world_size > 1:
        sys.exit(status)
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        sys.exit(status)
    os._exit(status)


def _without_nproc(argv: list[str]) -> list[str]:
    """ARGV less `--nproc N` / `--nproc=N`: what each rank runs under torchrun."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return kept


def _memory_hint(args: argparse.Namespace, error: Exception) -> str:
    """What a memory refusal adds where the command could have been given more."""
    if isinstance(error, MemoryBudgetError) and hasattr(args, "max_memory") and args.max_memory is None:
        return " (--max-memory SIZE to allow more)"
    return ""


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
