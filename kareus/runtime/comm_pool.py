"""A pool of communicators over the same ranks, one per SM share a plan uses.

The SM share of a collective is set per communicator: NCCL limits a communicator's CTAs
through ``ProcessGroupNCCL.Options().config.max_ctas`` where the torch build offers it.
A collective is pointed at its share's communicator by rewriting its group-name argument.

One pool serves the whole process (:func:`job_pool`), so each (ranks, share) communicator is
created once per job however many regions, stages or backends ask for it. Creation involves
the members of the collective's group only, never the other ranks of the job: in a TP × DP
or TP × PP job each TP group creates its own when it compiles, while other groups run,
wait in a pipeline receive, or compile other graphs. With NCCL on a device-bound default
group the communicator is split from the group's own (``split_group``: only its members
take part); otherwise it is a ``new_group`` with group-local synchronisation, whose name
torch derives from the ranks and the number of groups the process knows. The members
first check that they agree on that number (one small collective over their group); if
they do not, the share is not used and the reason is recorded rather than risking a hang.
With gloo, or a torch build without the option, the groups exist but the share has no
effect; :meth:`CommunicatorPool.to_text` says so, with what creating them cost.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from kareus._torch_internals import real_dispatch, resolve_group

_log = logging.getLogger(__name__)

_REDUCE_OPS = ("sum", "avg", "max", "min", "product", "band", "bor", "bxor")


class CommunicatorPool:
    """Process groups keyed by (ranks, SM share)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[tuple[int, ...], int], str] = {}
        self._cost_s: dict[tuple[tuple[int, ...], int], float] = {}
        self.notes: list[str] = []

    def group_name(self, base_name: str, sm_share: int) -> str:
        """Return the name of a group for ``sm_share`` SMs over ``base_name``'s ranks.

        The group is created on first use by the members of ``base_name`` (all of them must
        ask, in the same order: they compile the same graphs). Returns ``base_name`` when no
        share group can be made safely (the reason is in :attr:`notes`).
        """
        base = _resolve(base_name)
        ranks = tuple(dist.get_process_group_ranks(base))
        key = (ranks, sm_share)
        if key not in self._groups:
            start = time.perf_counter()
            with _plain_dispatch():
                self._groups[key] = self._create(list(ranks), sm_share, base, base_name)
            self._cost_s[key] = time.perf_counter() - start
            _log.info(
                "ranks %s: SM share %d -> group %r in %.1f ms",
                list(ranks),
                sm_share,
                self._groups[key],
                self._cost_s[key] * 1e3,
            )
        return self._groups[key]

    def _create(self, ranks: list[int], sm_share: int, base: Any, base_name: str) -> str:
        backend = dist.get_backend(base)
        options = None
        if backend == "nccl":
            try:
                options = dist.ProcessGroupNCCL.Options()
                options.config.max_ctas = sm_share
                options.config.min_ctas = min(sm_share, options.config.min_ctas or sm_share)
            except (AttributeError, RuntimeError) as err:
                options = None
                self._note_once(
                    f"NCCL CTA limits are not available in this torch build ({err}); the "
                    "share groups carry no SM limit"
                )
        else:
            self._note_once(
                f"backend {backend!r} has no SM share: the share groups are plain groups "
                "(the overlap order is still applied)"
            )
        default = dist.distributed_c10d._get_default_group()
        if backend == "nccl" and default.bound_device_id is not None:
            # Split the group's own communicator: a collective of its members only.
            group = dist.split_group(
                parent_pg=base, split_ranks=[list(range(len(ranks)))], pg_options=options
            )
            assert group is not None  # every member is in the one split
            return group.group_name
        known = len(dist.distributed_c10d._world.pg_names)
        counts: list[int | None] = [None] * len(ranks)
        dist.all_gather_object(counts, known, group=base)
        if len(set(counts)) > 1:
            # torch names the new group from this count: members that disagree would build
            # different groups and wait for each other forever.
            self._note_once(
                f"ranks {ranks}: the members know different numbers of process groups "
                f"({counts}), so a share group cannot be created without risking a hang; "
                "their collectives keep their own group (no SM share)"
            )
            return base_name
        group = dist.new_group(
            ranks, backend=backend, pg_options=options, use_local_synchronization=True
        )
        return group.group_name  # type: ignore[union-attr]

    def to_text(self) -> str:
        """Describe the groups, what creating them cost, and notes (``kareus.explain``)."""
        lines = [
            f"ranks {list(r)}: SM share {s} -> group {g!r} "
            f"(created in {self._cost_s[(r, s)] * 1e3:.1f} ms, measured)"
            for (r, s), g in self._groups.items()
        ]
        return "\n".join(lines + self.notes) or "no extra communicators"

    def _note_once(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def regroup(self, requests: list[tuple[Any, int]]) -> bool:
        """Point each collective ``issue`` node of ``requests`` at its share's group.

        The groups missing from the pool are created first, in one order shared by every
        rank of the job (by ranks, then share), whatever order the graph lists them in:
        creating a group waits for its members, so two ranks creating two groups in
        opposite orders would wait for each other forever.

        Returns:
            Whether any node's group changed.
        """
        wanted = []
        for issue, share in requests:
            i = _group_arg(issue)
            if i is not None:
                wanted.append((issue, i, share))
        needed = {(issue.args[i], share) for issue, i, share in wanted}
        for _ranks, share, name in sorted(
            (tuple(dist.get_process_group_ranks(_resolve(name))), share, name)
            for name, share in needed
        ):
            self.group_name(name, share)
        changed = False
        for issue, i, share in wanted:
            args = list(issue.args)
            new = self.group_name(args[i], share)
            if new != args[i]:
                args[i] = new
                issue.args = tuple(args)
                changed = True
        return changed


@contextlib.contextmanager
def _plain_dispatch() -> Iterator[None]:
    """Run real collectives from inside a compiler pass, as eager code runs them.

    Passes run under AOTAutograd's fake mode and its Python dispatcher. Under the latter a
    gloo collective deadlocks at random: the calling thread holds the GIL (the dispatcher
    took it) while it waits for gloo's work queue, and gloo's worker holds the queue while
    it frees the previous collective's tensors, which needs the GIL.
    """
    with real_dispatch():
        yield


def _resolve(name: str) -> Any:
    return resolve_group(name)


def _group_arg(issue: Any) -> int | None:
    """Return the position of a collective node's group-name argument (the last string)."""
    for i in range(len(issue.args) - 1, -1, -1):
        if isinstance(issue.args[i], str) and issue.args[i] not in _REDUCE_OPS:
            return i
    return None


_JOB_POOL: tuple[Any, CommunicatorPool] | None = None


def job_pool() -> CommunicatorPool:
    """Return the process's pool: one per job, shared by every backend and region."""
    global _JOB_POOL
    default = dist.distributed_c10d._get_default_group()
    if _JOB_POOL is None or _JOB_POOL[0] is not default:
        _JOB_POOL = (default, CommunicatorPool())
    return _JOB_POOL[1]
