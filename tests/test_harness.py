"""The test harness itself: ranks start from a fork server that has already imported what every
rank needs (`_harness.rank_context`), so no test pays for it per rank."""

import os
import sys

import pytest
import torch.distributed as dist

from _harness import run_ranks


_PRELOADED = ("_models", "_forkserver_warmup", "torch._inductor.compile_fx")


def _already_imported(rank, world_size):
    return {name: name in sys.modules for name in _PRELOADED}


def test_ranks_inherit_the_fork_servers_preloads():
    """Python 3.11's fork server imported its preloads on the interpreter's default sys.path and
    silently dropped the test modules: every rank imported them, and Inductor, again."""
    assert run_ranks(_already_imported, 2) == dict.fromkeys(_PRELOADED, True)


def _rank_1_aborts(rank, world_size):
    if rank == 1:
        os.write(2, b"terminate called after throwing an instance of 'gloo::EnforceNotMet'\n")
        os.abort()  # as C++'s std::terminate does, with no Python traceback
    dist.barrier()  # rank 0 waits in a collective: gloo tells it the connection was reset


def test_a_rank_that_aborts_is_named_first_with_its_stderr():
    """A rank killed by a C++ abort reports no traceback; the test fails naming it and its exit code,
    with what it wrote to stderr before dying and faulthandler's stacks, ahead of the other ranks'
    errors (which only say the connection was reset)."""
    with pytest.raises(AssertionError) as failure:
        run_ranks(_rank_1_aborts, 2)
    report = str(failure.value)
    assert report.startswith("rank 1 died without a report: exit code -6"), report[:300]
    assert "terminate called after throwing an instance of 'gloo::EnforceNotMet'" in report
    assert "Fatal Python error: Aborted" in report
