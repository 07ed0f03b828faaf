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
import logging
import sys
from collections.abc import Sequence

from kareus.cli.commands import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INFEASIBLE,
    EXIT_OK,
    _doctor,
    _evaluate,
    _explain,
    _list,
    _plan,
    _profile,
    _restore_clocks,
)
from kareus.cli.options import _parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
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
        if args.command == "plan":
            return _plan(args)
        if args.command == "profile":
            return _profile(args)
        if args.command == "evaluate":
            return _evaluate(args)
        if args.command == "explain":
            return _explain(args.plan)
        if args.command == "restore-clocks":
            return _restore_clocks(args.journal)
        if args.command == "doctor":
            return _doctor(args)
        return _list()
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
