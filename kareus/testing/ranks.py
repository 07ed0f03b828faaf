"""Running a function in several processes joined by a gloo group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    port: int,
    out: str,
    args: Any,
    timeout_s: float,
    environ: dict[str, str],
) -> None:
    import datetime
    import faulthandler
    import os
    import sys

    import torch.distributed as dist

    # A forkserver's child inherits the server's environment, not the caller's: the caller's
    # (as a spawned child would have it) replaces it.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    from kareus.testing.breaks import break_kareus

    break_kareus()  # KAREUS_BREAK reaches every rank, as the test's own process
    # A rank stuck past the timeout prints where every thread waits, then exits: a hang
    # becomes a failure that names each rank and its line. Every rank dumps before any
    # exits (an exit makes the parent kill the others).
    print(f"[rank {rank}] stack dump follows if it hangs past {timeout_s:g} s", file=sys.stderr)
    faulthandler.dump_traceback_later(timeout_s, exit=False)
    import threading

    killer = threading.Timer(timeout_s + 10, os._exit, args=(1,))
    killer.daemon = True
    killer.start()
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        try:
            result = fn(rank, *args)
        except BaseException:
            import traceback

            # Printed now: if tearing the group down hangs, the error is still seen.
            print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
        torch.save(result, f"{out}.{rank}")
    finally:
        faulthandler.cancel_dump_traceback_later()
        killer.cancel()
        dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "kareus", "kareus.testing"]


def run_ranks(
    fn: Callable[..., Any], *args: Any, world: int = 2, timeout_s: float = 180.0
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``world`` processes joined by a gloo group.

    ``fn`` must be importable (defined at module level). Returns each rank's return value
    (anything ``torch.save`` can store). Raises if any rank fails. A rank that is still
    running after ``timeout_s`` prints every thread's stack (where it waits) and exits, and
    a collective that waits that long raises in its rank: a hang fails with the place.

    Ranks are forked from a server process that has imported torch and kareus once
    (``forkserver``), with the caller's working directory, ``sys.path`` and environment, as
    spawned ones would have: a spawned rank spent about 3 s importing them (an empty run of
    8 ranks took 12.9 s on 2 cores).
    """
    import multiprocessing.forkserver
    import os
    import tempfile

    import torch.multiprocessing as mp

    multiprocessing.forkserver.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result"
        mp.start_processes(
            _rank_main,
            args=(fn, world, free_port(), out, args, timeout_s, dict(os.environ)),
            nprocs=world,
            start_method="forkserver",
        )
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
