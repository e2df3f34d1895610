"""What each rank tells the other ranks of its mesh about how it runs its groups under torch.compile.

Per set of ranks, each rank keeps a sequence of entries in the default process group's store: one
for each graph it compiles that holds collectives of some group (written by the compile backend),
and one for each group whose hooks first run eagerly inside a compiled call (a fallback, written by
traced/hooks.py). Ranks that run the same program write the same sequence, so the n-th entries
agree; the backend compares them before it schedules a graph of several groups
([Note: Ranks that compile different graphs] in fsdp_graph/compile/agreement.py, which states the
whole protocol). Writing needs no collective, so a rank that traced less than another never blocks
on it.

The invariant this file keeps: each rank's sequence per set of ranks is append-only, numbered from
0 within one log, and one log is one default process group's ([Note: One log per process group]).

[Note: One log per process group]
The log is the default process group's: `PeerLog.of_default_group` hangs it on that group object
(weakly), so destroying the group and initialising another starts a fresh log, numbered from 0,
with no set of ranks marked out of step. The store may outlive the group that made it and keep
every key of the old log: a FileStore on the same path, torchrun's store, a store the user passes
again. A new log must not read those entries as its own, and the ranks must agree which log is new
without a collective. So each rank counts in the store the logs it has begun there
(`begun/<rank>`, incremented when this rank's log of a process group starts), and a log's keys
carry that count: the k-th log of every rank is the same process group's. That holds where every
rank that tells anything in a process group's life has a log in each earlier one that another rank
told in, which is so for a program that compiles its models on every rank.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

_PREFIX = "fsdp_graph/peer_log"


class PeerLog:
    """One default process group's log: this rank's sequences, one per set of ranks, and the sets
    of ranks marked out of step (seen to compile different graphs: their later entries are still
    written, in order, but no longer compared; [Note: Ranks that compile different graphs])."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self._store = store
        self._rank = rank
        # Which of this rank's logs in this store this one is: [Note: One log per process group].
        self._generation = store.add(f"{_PREFIX}/begun/{rank}", 1)
        self._next_index: dict[tuple[int, ...], int] = {}
        self._out_of_step: set[tuple[int, ...]] = set()  # marked by this rank or seen marked by another

    @staticmethod
    def of_default_group(begin: bool = True) -> Optional["PeerLog"]:
        """The default process group's log, begun on first use (with `begin`, else None until
        then); None where there is nobody to tell (no process group, one rank, or the fake process
        group of the graph tests and predictions)."""
        if not dist.is_initialized() or dist.get_world_size() < 2 or dist.get_backend() == "fake":
            return None
        group = dist.distributed_c10d._get_default_group()
        log = _logs.get(group)
        if log is None and begin:
            log = _logs[group] = PeerLog(dist.distributed_c10d._get_default_store(), dist.get_rank())
        return log

    def _key(self, ranks: tuple[int, ...], index: int, rank: object) -> str:
        return f"{_PREFIX}/{self._generation}/{','.join(map(str, ranks))}/{index}/{rank}"

    def _mark_key(self, ranks: tuple[int, ...]) -> str:
        return f"{_PREFIX}/{self._generation}/{','.join(map(str, ranks))}/out_of_step"

    def mark_out_of_step(self, ranks: Sequence[int]) -> None:
        """Mark `ranks` out of step, for every rank of them to see (`out_of_step`)."""
        ranks = tuple(sorted(ranks))
        if ranks not in self._out_of_step:
            self._out_of_step.add(ranks)
            self._store.set(self._mark_key(ranks), "1")

    def out_of_step(self, ranks: Sequence[int]) -> bool:
        """Whether any rank has marked `ranks` out of step by now. A mark is written before the
        marking rank's next entry, so a rank that has read that entry sees the mark."""
        ranks = tuple(sorted(ranks))
        if ranks not in self._out_of_step and self._store.check([self._mark_key(ranks)]):
            self._out_of_step.add(ranks)
        return ranks in self._out_of_step

    def marked_out_of_step(self) -> frozenset[tuple[int, ...]]:
        """The sets of ranks this rank has marked, or seen marked, out of step."""
        return frozenset(self._out_of_step)

    def tell(self, ranks: Sequence[int], entry: str) -> Optional[int]:
        """Append `entry` to this rank's sequence for `ranks`; its index, or None if this rank is
        not among `ranks` or is alone in them."""
        ranks = tuple(sorted(ranks))
        if len(ranks) < 2 or self._rank not in ranks:
            return None
        index = self._next_index.get(ranks, 0)
        self._next_index[ranks] = index + 1
        self._store.set(self._key(ranks, index, self._rank), entry)
        return index

    def decide(self, ranks: Sequence[int], index: int, verdict: str) -> None:
        """Write what the lowest of `ranks` concluded about entry `index` (the others read it)."""
        self._store.set(self._key(tuple(sorted(ranks)), index, "verdict"), verdict)

    def read(self, ranks: Sequence[int], index: int, rank: object, timeout_s: float) -> Optional[str]:
        """Rank `rank`'s entry `index` for `ranks` (or with rank "verdict", what the lowest rank
        decided about it), waiting up to `timeout_s`; None if nothing was written by then."""
        key = self._key(tuple(sorted(ranks)), index, rank)
        try:
            self._store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
        except (dist.DistStoreError, RuntimeError):  # timed out
            return None
        return self._store.get(key).decode()


# Each default process group's log, held as long as the group object lives:
# [Note: One log per process group].
_logs: "weakref.WeakKeyDictionary[dist.ProcessGroup, PeerLog]" = weakref.WeakKeyDictionary()


def tell(ranks: Sequence[int], entry: str) -> Optional[int]:
    """Append `entry` to this rank's sequence for `ranks` in the default process group's log; its
    index, or None if there is nobody to tell."""
    log = PeerLog.of_default_group()
    return None if log is None else log.tell(ranks, entry)
