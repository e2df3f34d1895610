"""The reorder pass measures its candidate moves from the order it has measured
([Note: Measuring a move] in passes/measured_order.py): the numbers of whole simulations, at a cost
that grows linearly with depth. One process, a fake process group, a fixed cost model.
"""

import copy
import dataclasses
import random
import unittest

import torch

from _harness import fake_process_group
from _models import shard_blocks_then_root
from _schedule_helpers import FIXED, Stack, capture_graphs, sharded_embed_stack, sharded_stack
from fsdp_graph.passes.bucketing import bucket_by_group
from fsdp_graph.passes.measured_order import MeasuredOrder
from fsdp_graph.passes.nodes import is_collective
from fsdp_graph.passes.reorder import SCHEDULE_META, reorder_for_overlap
from fsdp_graph.passes.simulator import OrderCost, all_gathers_in_flight, in_flight, op_of, simulate


def _shuffled_window(order: list, lo: int, hi: int, rng: random.Random) -> list:
    """Positions lo..hi-1 of `order` in another topological order, picked at random."""
    nodes = order[lo:hi]
    inside = set(nodes)
    waiting = {n: {i for i in n.all_input_nodes if i in inside} for n in nodes}
    done: list = []
    while len(done) < len(nodes):
        ready = [n for n in nodes if n not in done and waiting[n] <= set(done)]
        done.append(rng.choice(ready))
    return done


def _whole_simulation(ops: dict, order: list) -> tuple:
    program = [ops[n] for n in order]
    sim = simulate(program, FIXED)
    return sim.memory.peak_bytes, sim.exposed_comm_s, (*in_flight(program), all_gathers_in_flight(program))


class MeasuredOrderTest(unittest.TestCase):
    def setUp(self) -> None:
        self._pg = fake_process_group(8)
        self._pg.__enter__()

    def tearDown(self) -> None:
        self._pg.__exit__(None, None, None)

    def test_a_move_measures_as_a_whole_simulation(self):
        """Random windows of unscheduled and scheduled graphs, shuffled, measured and sometimes
        accepted: each measure is what `simulate`, `in_flight` and `all_gathers_in_flight` give for
        the whole program, with and without gloo's scratch copies."""
        embed = capture_graphs(sharded_embed_stack(), torch.randint(0, 256, (4, 8)))
        graphs = {**capture_graphs(sharded_stack(), torch.randn(4, 16)), **{f"embed {k}": g for k, g in embed.items()}}
        for name, gm in graphs.items():
            for scheduled in (False, True):
                graph = bucket_by_group(copy.deepcopy(gm))
                if scheduled:
                    graph = reorder_for_overlap(graph, FIXED)
                ops = {n: op_of(n) for n in graph.graph.nodes}
                gloo_like = {n: dataclasses.replace(op, scratch_bytes=op.out_bytes) if is_collective(n) else op
                             for n, op in ops.items()}
                for with_scratch, graph_ops in ((False, ops), (True, gloo_like)):
                    rng = random.Random(0)
                    measured = MeasuredOrder(OrderCost(graph_ops, FIXED), list(graph.graph.nodes))
                    n = len(measured.order)
                    for step in range(60):
                        lo = rng.randrange(1, n - 1)
                        hi = min(n - 1, lo + rng.choice([2, 8, 40, n]))
                        window = _shuffled_window(measured.order, lo, hi, rng)
                        expected = _whole_simulation(graph_ops, measured.order[:lo] + window + measured.order[hi:])
                        where = f"{name}, scheduled={scheduled}, scratch={with_scratch}, step {step}"
                        self.assertEqual(measured.measure(window, lo, hi), expected, where)
                        if rng.random() < 0.3:
                            measured.accept(window, lo, hi)
                            self.assertEqual((measured.peak, measured.exposed, measured.flight), expected, where)


class ScalingTest(unittest.TestCase):
    """Counts, not timings: the candidates the pass measures and the node positions it simulates
    to measure them, for stacks of 4, 8 and 16 blocks."""

    def setUp(self) -> None:
        self._pg = fake_process_group(8)
        self._pg.__enter__()

    def tearDown(self) -> None:
        self._pg.__exit__(None, None, None)

    def reports(self, num_blocks: int) -> dict:
        torch.manual_seed(0)
        model = Stack(num_blocks=num_blocks)
        shard_blocks_then_root(model)
        graphs = capture_graphs(model, torch.randn(4, 16))
        scheduled = {kind: reorder_for_overlap(bucket_by_group(gm), FIXED) for kind, gm in graphs.items()}
        return {kind: gm.meta[SCHEDULE_META] for kind, gm in scheduled.items()}

    def test_measures_and_simulated_positions_grow_linearly(self):
        reports = {n: self.reports(n) for n in (4, 8, 16)}
        for kind in ("forward", "backward"):
            measured = [reports[n][kind].num_measured for n in (4, 8, 16)]
            simulated = [reports[n][kind].num_simulated for n in (4, 8, 16)]
            # A whole simulation per candidate (and per accepted move) grew 4x per doubling.
            for fewer, more in ((0, 1), (1, 2)):
                self.assertLessEqual(measured[more], 2.1 * measured[fewer], (kind, measured))
                # The backward's wait of each reduce-scatter is also tried at the graph's end: a window
                # from the wait to the end, the one part that still grows with depth squared.
                bound = 2.2 if kind == "forward" else 2.8
                self.assertLessEqual(simulated[more], bound * simulated[fewer], (kind, simulated))
