"""What each rank tells the other ranks of its mesh about how it runs its groups under torch.compile.

Per set of ranks, each rank keeps a sequence of entries in the process group's store: one for each
graph it compiles that holds collectives of some group (written by the compile backend), and one
for each group whose hooks first run eagerly inside a compiled call (a fallback, written by
traced/unshard.py). Ranks that run the same program write the same sequence, so the n-th entries
agree; the backend compares them before it schedules a graph of several groups
([Note: Ranks that compile different graphs] in fsdp_graph/compile/agreement.py). Writing needs no
collective, so a rank that traced less than another never blocks on it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

_PREFIX = "fsdp_graph/peer_log"
_next_index: dict[tuple[int, ...], int] = {}


def _store() -> Optional[dist.Store]:
    """The default process group's store; None where there is nobody to tell (no process group, one
    rank, or the fake process group of the graph tests and predictions)."""
    if not dist.is_initialized() or dist.get_world_size() < 2 or dist.get_backend() == "fake":
        return None
    return dist.distributed_c10d._get_default_store()


def _key(ranks: tuple[int, ...], index: int, rank: object) -> str:
    return f"{_PREFIX}/{','.join(map(str, ranks))}/{index}/{rank}"


def tell(ranks: Sequence[int], entry: str) -> Optional[int]:
    """Append `entry` to this rank's sequence for `ranks`; its index, or None if there is nobody to tell."""
    ranks = tuple(sorted(ranks))
    store = _store()
    if store is None or len(ranks) < 2 or dist.get_rank() not in ranks:
        return None
    index = _next_index.get(ranks, 0)
    _next_index[ranks] = index + 1
    store.set(_key(ranks, index, dist.get_rank()), entry)
    return index


def decide(ranks: Sequence[int], index: int, verdict: str) -> None:
    """Write what the lowest of `ranks` concluded about entry `index` (the others read it)."""
    _store().set(_key(tuple(sorted(ranks)), index, "verdict"), verdict)


def read(ranks: Sequence[int], index: int, rank: object, timeout_s: float) -> Optional[str]:
    """Rank `rank`'s entry `index` for `ranks` (or with rank "verdict", what the lowest rank decided
    about it), waiting up to `timeout_s`; None if nothing was written by then."""
    store = _store()
    key = _key(tuple(sorted(ranks)), index, rank)
    try:
        store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
    except (dist.DistStoreError, RuntimeError):  # timed out
        return None
    return store.get(key).decode()
