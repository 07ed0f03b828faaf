r"""The ``kareus`` command line.

    kareus plan --model llama3.2-3b --gpu a100-40gb --tp 8 --pp 2 --microbatch-size 8 \\
        --seq-len 4096 --microbatches 8 --select iso_time --out kareus-out
    kareus evaluate --model llama3.2-3b --tp 8 --pp 2 --recompute full --clocks plans.csv
    kareus explain kareus-out/plan.json
    kareus list

Exit status: 0 done; 2 bad input (unknown model or GPU, parallel sizes that do not divide
the model, unreadable files); 3 no plan meets the selection policy; 1 any other failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kareus.cli import commands as _c
from kareus.cli import options as _o
from kareus.cli.commands import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INFEASIBLE, EXIT_OK


@dataclasses.dataclass(frozen=True)
class Command:
    """One command of the command line: where a command is declared.

    Attributes:
        options: adds the command's subparser (its name, help and options) and returns it.
        run: runs it on the parsed arguments; returns the exit status.
    """

    options: Callable[[Any], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace], int]


COMMANDS: tuple[Command, ...] = (
    Command(_o._plan_parser, _c._plan),
    Command(_o._profile_parser, _c._profile),
    Command(_o._evaluate_parser, _c._evaluate),
    Command(_o._explain_parser, lambda args: _c._explain(args.plan)),
    Command(_o._list_parser, lambda args: _c._list()),
    Command(_o._restore_clocks_parser, lambda args: _c._restore_clocks(args.journal)),
    Command(_o._doctor_parser, _c._doctor),
)
"""The commands, in the order ``kareus --help`` lists them: add a command here."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _o._parser(COMMANDS).parse_args(argv)
    if not args.verbose:
        return _run(args)
    # The command's own handler on kareus's logger, for this command only.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("kareus: %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("kareus")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO)
    try:
        return _run(args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    from kareus.errors import KareusError
    from kareus.planner.select import InfeasiblePlanError

    try:
        return int(args.run(args))
    except InfeasiblePlanError as err:
        print(f"kareus: no plan meets --select {args.select}: {err}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except (ValueError, FileNotFoundError, KareusError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"kareus: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT if _bad_input(err) else EXIT_FAILED


def _bad_input(err: Exception) -> bool:
    from kareus.errors import TraceError

    return not isinstance(err, TraceError)


__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_INFEASIBLE", "EXIT_OK", "main"]
