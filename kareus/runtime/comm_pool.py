"""A pool of communicators over the same ranks, one per SM share a plan uses.

The SM share of a collective is set per communicator: NCCL limits a communicator's CTAs
through ``ProcessGroupNCCL.Options().config.max_ctas`` where the torch build offers it.
Groups are created once, collectively (every rank compiles the same graphs in the same
order), and chosen per collective by rewriting its group-name argument. With gloo, or a
torch build without the option, the groups exist but the share has no effect; the reason is
recorded in :attr:`CommunicatorPool.notes`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class CommunicatorPool:
    """Process groups keyed by (ranks, SM share)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[tuple[int, ...], int], str] = {}
        self.notes: list[str] = []

    def group_name(self, base_name: str, sm_share: int) -> str:
        """Return the name of a group for ``sm_share`` SMs over ``base_name``'s ranks.

        The group is created (collectively) on first use.
        """
        base = dist.distributed_c10d._resolve_process_group(base_name)  # type: ignore[arg-type]
        ranks = tuple(dist.get_process_group_ranks(base))
        key = (ranks, sm_share)
        if key not in self._groups:
            self._groups[key] = self._create(list(ranks), sm_share, base)
        return self._groups[key]

    def _create(self, ranks: list[int], sm_share: int, base: Any) -> str:
        backend = dist.get_backend(base)
        options = None
        if backend == "nccl":
            try:
                options = dist.ProcessGroupNCCL.Options()
                options.config.max_ctas = sm_share
                options.config.min_ctas = min(sm_share, options.config.min_ctas or sm_share)
            except (AttributeError, RuntimeError) as err:
                options = None
                self.notes.append(
                    f"NCCL CTA limits are not available in this torch build ({err}); one "
                    "communicator serves every SM share"
                )
        else:
            self._note_once(f"backend {backend!r} has no SM share; groups are plain")
        group = dist.new_group(ranks, backend=backend, pg_options=options)
        return group.group_name  # type: ignore[union-attr]

    def to_text(self) -> str:
        """Describe the groups and notes (used by ``kareus.explain``)."""
        lines = [f"ranks {r}: SM share {s} -> group {g!r}" for (r, s), g in self._groups.items()]
        return "\n".join(lines + self.notes) or "no extra communicators"

    def _note_once(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def regroup(self, issue: Any, sm_share: int) -> bool:
        """Point the collective ``issue`` node at the group for ``sm_share``.

        Returns:
            Whether the node's group changed.
        """
        args = list(issue.args)
        for i in range(len(args) - 1, -1, -1):
            if isinstance(args[i], str) and args[i] not in ("sum", "avg", "max", "min"):
                new = self.group_name(args[i], sm_share)
                if new == args[i]:
                    return False
                args[i] = new
                issue.args = tuple(args)
                return True
        return False
