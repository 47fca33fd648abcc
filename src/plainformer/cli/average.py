"""`plainformer average`: the mean of several checkpoints' weights (Vaswani et al. 2017, section 6.1), as
one checkpoint that every other command reads."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..checkpoint.average import KEPT_DIR, average_checkpoints, kept_checkpoints
from ..log import log
from . import UserError, positive_int


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "average", help="average the weights of several checkpoints of one model",
        description="Write to --out the checkpoint whose weights are the mean of those of CKPT... (checkpoint "
                    "directories of one model), or of the last --last checkpoints a run kept (a RUN given alone, "
                    f"trained with --keep-checkpoints: RUN/{KEPT_DIR}/step-*). Ends with one JSON line.")
    parser.add_argument("ckpt", nargs="+", type=Path, metavar="CKPT",
                        help="checkpoint directories, or one run directory")
    parser.add_argument("--last", type=positive_int, metavar="N",
                        help="of a run's kept checkpoints, the newest N (default: all it kept)")
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    parser.set_defaults(run=run_average)


def chosen_checkpoints(paths: list[Path], last: int | None) -> list[Path]:
    """The checkpoints `paths` name: themselves, or the kept checkpoints of the one run given."""
    kept = kept_checkpoints(paths[0]) if len(paths) == 1 else []
    if kept:
        return kept[-last:] if last else kept
    if last is not None:
        raise UserError(f"--last takes one run directory that kept checkpoints ({KEPT_DIR}/step-*), got "
                        f"{', '.join(map(str, paths))}")
    if len(paths) < 2:
        raise UserError(f"{paths[0]} is no run that kept checkpoints ({KEPT_DIR}/step-*): give two checkpoints or "
                        "more to average")
    return paths


def check_out(out: Path, checkpoints: list[Path]) -> None:
    """--out may lie in a run directory (RUN/averaged), but is none of the checkpoints averaged, nor inside one,
    nor a run's last/, which its resume reads."""
    target = out.resolve()
    for path in checkpoints:
        if target == path.resolve() or path.resolve() in target.parents:
            raise UserError(f"--out {out} would replace {path}, one of the checkpoints averaged: write it elsewhere")
    if out.name == "last":
        raise UserError(f"--out {out}: a run's last/ is what --resume continues; write the average elsewhere")


def run_average(args: argparse.Namespace) -> dict[str, Any]:
    checkpoints = chosen_checkpoints(args.ckpt, args.last)
    check_out(args.out, checkpoints)
    average_checkpoints(checkpoints, args.out)
    log(f"the mean of {len(checkpoints)} checkpoints -> {args.out}")
    return {"averaged": len(checkpoints), "checkpoints": [str(p) for p in checkpoints], "out": str(args.out)}
