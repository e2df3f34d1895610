"""The test harness itself: ranks start from a fork server that has already imported what every
rank needs (`_harness.rank_context`), so no test pays for it per rank."""

import sys

from _harness import run_ranks


_PRELOADED = ("_models", "_forkserver_warmup", "torch._inductor.compile_fx")


def _already_imported(rank, world_size):
    return {name: name in sys.modules for name in _PRELOADED}


def test_ranks_inherit_the_fork_servers_preloads():
    """Python 3.11's fork server imported its preloads on the interpreter's default sys.path and
    silently dropped the test modules: every rank imported them, and Inductor, again."""
    assert run_ranks(_already_imported, 2) == dict.fromkeys(_PRELOADED, True)
