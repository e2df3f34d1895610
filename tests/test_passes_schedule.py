"""Scheduling passes on one process, a fake process group of 8 ranks and a fixed cost model.

Update the inline expectations with `EXPECTTEST_ACCEPT=1`.
"""

import copy
import dataclasses

import expecttest
import torch

from _harness import fake_process_group
from _schedule_helpers import (
    FIXED, LATENCY_BOUND, capture_graphs, cost_cases, schedule_lines, sharded_embed_stack, sharded_stack,
    tensor_parallel_stack,
)
from fsdp_graph.passes.bucketing import auto_bucket, bucket_by_group, buckets
from fsdp_graph.passes.cost_model import CollectiveKind, CostModel, Profile
from fsdp_graph.passes.nodes import is_collective, is_fsdp_collective, parallelism_of, tensor_bytes
from fsdp_graph.passes.reorder import SCHEDULE_META, reorder_for_overlap

UNLIMITED = 1 << 50  # a memory budget nothing reaches: the schedule overlap alone decides
from fsdp_graph.passes.simulator import (
    Op, OpKind, OrderCost, all_gathers_in_flight, in_flight, in_flight_bytes, memory_profile, program_of,
    saved_inputs, simulate,
)

# Up and down weights of one block, fp32, all ranks, and one gradient flag per weight and rank
# ([Note: Gradient flags in a graph]); the root's one weight and its flag, and a zero column that
# makes the flags even ([Note: An even number of flag columns]).
_BLOCK_BYTES = (16 * 32 * 2 + 8 * 2) * 4
_ROOT_BYTES = (16 * 8 + 8 * 2) * 4


class SchedulingPassTest(expecttest.TestCase):
    def setUp(self) -> None:
        self._pg = fake_process_group(8)
        self._pg.__enter__()

    def tearDown(self) -> None:
        self._pg.__exit__(None, None, None)

    def graphs(self, **shard_kwargs):
        return capture_graphs(sharded_stack(**shard_kwargs), torch.randn(4, 16))

    def test_cost_model_collective_formula(self):
        nvlink = CostModel("h100-nvlink")
        p = Profile.H100_NVLINK.value
        seconds = nvlink.collective_seconds(CollectiveKind.ALL_GATHER, 8 << 20, 8)
        self.assertAlmostEqual(seconds, p.collective_latency_s + 7 / 8 * (8 << 20) / p.bus_bytes_per_s)
        self.assertAlmostEqual(
            nvlink.collective_seconds(CollectiveKind.ALL_REDUCE, 8 << 20, 8) - p.collective_latency_s,
            2 * (seconds - p.collective_latency_s),
        )
        with self.assertRaisesRegex(ValueError, "Unknown hardware profile 'a100'"):
            CostModel("a100")

    def test_bucket_by_group_is_the_eager_plan(self):
        graphs = self.graphs()
        forward = bucket_by_group(graphs["forward"])
        self.assertEqual(
            [(b["op"], b["groups"], b["bytes"]) for b in buckets(forward)],
            [("all_gather", ["<root>"], _ROOT_BYTES), *[("all_gather", [f"blocks.{i}"], _BLOCK_BYTES) for i in range(3)]],
        )
        backward = bucket_by_group(graphs["backward"])
        self.assertEqual(
            [(b["op"], b["groups"]) for b in buckets(backward)],
            [("all_gather", ["blocks.2"]), ("reduce_scatter", ["blocks.2"]), ("all_gather", ["blocks.1"]),
             ("reduce_scatter", ["blocks.1"]), ("all_gather", ["blocks.0"]), ("reduce_scatter", ["blocks.0"]),
             ("reduce_scatter", ["<root>"])],
        )

    def test_auto_bucket_merges_latency_bound_buckets_up_to_the_cap(self):
        graphs = self.graphs()
        forward = auto_bucket(bucket_by_group(graphs["forward"]), LATENCY_BOUND, bucket_cap_bytes=2 * _BLOCK_BYTES + _ROOT_BYTES)
        self.assertEqual(
            [(b["groups"], b["bytes"]) for b in buckets(forward)],
            [(["<root>", "blocks.0", "blocks.1"], _ROOT_BYTES + 2 * _BLOCK_BYTES), (["blocks.2"], _BLOCK_BYTES)],
        )
        backward = auto_bucket(bucket_by_group(graphs["backward"]), LATENCY_BOUND, bucket_cap_bytes=1 << 20)
        self.assertEqual(
            [(b["op"], b["groups"]) for b in buckets(backward)],
            [("all_gather", ["blocks.2", "blocks.1", "blocks.0"]),
             ("reduce_scatter", ["blocks.2", "blocks.1", "blocks.0", "<root>"])],
        )

    def test_auto_bucket_leaves_bandwidth_bound_buckets_and_splits_over_the_cap(self):
        forward = auto_bucket(bucket_by_group(self.graphs()["forward"]), FIXED, bucket_cap_bytes=_BLOCK_BYTES // 2)
        self.assertEqual(
            [(b["groups"], b["bytes"]) for b in buckets(forward)],
            [(["<root>"], _ROOT_BYTES)] + [([f"blocks.{i}"], _BLOCK_BYTES // 2) for i in range(3) for _ in range(2)],
        )

    def test_reorder_forward_prefetches_the_next_all_gather(self):
        forward = reorder_for_overlap(bucket_by_group(self.graphs()["forward"]), FIXED)
        # AG(i+1) is issued before wait(AG(i)), hence before compute(i). Two ahead would hide no
        # more (the all-gathers read the shard buffers in place: no copy-in runs before them), and
        # the smallest depth with the least exposure wins.
        self.assertExpectedInline(schedule_lines(forward), """\
AG <root>
AG blocks.0
wait AG <root>
AG blocks.1
wait AG blocks.0
mm
mm
AG blocks.2
wait AG blocks.1
mm
mm
wait AG blocks.2
mm
mm
mm""")
        report = forward.meta[SCHEDULE_META]
        self.assertLess(report.exposed_s_after, report.exposed_s_before)

    def test_reorder_backward_regathers_ahead_and_waits_reduce_scatters_late(self):
        backward = reorder_for_overlap(bucket_by_group(self.graphs()["backward"]), FIXED, memory_budget_bytes=UNLIMITED)
        # The head's gradient (RS <root>) is ready from the first mm on: it is issued before the
        # last four mms (blocks.1's input gradient, blocks.0's gradients), not after RS blocks.0.
        self.assertExpectedInline(schedule_lines(backward), """\
AG blocks.2
mm
mm
mm
AG blocks.1
wait AG blocks.2
mm
mm
mm
RS blocks.2
mm
AG blocks.0
wait AG blocks.1
mm
mm
RS blocks.1
wait RS blocks.2
RS <root>
mm
wait RS blocks.1
mm
wait AG blocks.0
mm
mm
RS blocks.0
wait RS <root>
wait RS blocks.0""")

    def test_reorder_issues_the_root_reduce_scatter_before_the_first_blocks_weight_gradients(self):
        backward = capture_graphs(sharded_embed_stack(), torch.randint(0, 256, (4, 8)))["backward"]
        gm = reorder_for_overlap(bucket_by_group(copy.deepcopy(backward)), FIXED, memory_budget_bytes=UNLIMITED)
        # RS <root> needs only blocks.0's input gradient (the embedding's): it is issued before the
        # last mm, blocks.0's weight gradient, and RS blocks.0, which then run under it.
        self.assertExpectedInline(schedule_lines(gm), """\
AG blocks.1
mm
mm
mm
AG blocks.0
wait AG blocks.1
mm
mm
mm
RS blocks.1
mm
wait AG blocks.0
mm
mm
wait RS blocks.1
RS <root>
mm
RS blocks.0
wait RS <root>
wait RS blocks.0""")
        report = gm.meta[SCHEDULE_META]
        self.assertEqual(len(report.hoisted), 1)
        # A budget at the unscheduled peak leaves no room for the root's input to be computed
        # earlier: the root's reduce-scatter stays last, the reason is recorded, nothing fails.
        tight = reorder_for_overlap(
            bucket_by_group(copy.deepcopy(backward)), FIXED, memory_budget_bytes=report.peak_bytes_before
        )
        tight_report = tight.meta[SCHEDULE_META]
        self.assertEqual(tight_report.hoisted, [])
        self.assertIn("not issued before", " ".join(reason for _, reason in tight_report.rejected))
        self.assertTrue(schedule_lines(tight).endswith("RS <root>\nwait RS <root>"))
        self.assertLessEqual(simulate(tight, FIXED).memory.peak_bytes, report.peak_bytes_before)
        self.assertLess(report.exposed_s_after, tight_report.exposed_s_after)

    def test_default_headroom_bounds_sunk_reduce_scatter_waits(self):
        gm = bucket_by_group(self.graphs()["backward"])
        largest = max(
            max([tensor_bytes(n)] + [tensor_bytes(i) for i in n.all_input_nodes]) for n in gm.graph.nodes if is_collective(n)
        )
        default = reorder_for_overlap(gm, FIXED).meta[SCHEDULE_META]
        unlimited = reorder_for_overlap(
            bucket_by_group(self.graphs()["backward"]), FIXED, memory_budget_bytes=UNLIMITED
        ).meta[SCHEDULE_META]
        self.assertLessEqual(default.peak_bytes_after, default.peak_bytes_before + 2 * largest)
        self.assertGreater(unlimited.peak_bytes_after, default.peak_bytes_before + 2 * largest)
        self.assertLess(default.exposed_s_after, default.exposed_s_before)  # still overlaps

    def test_memory_budget_gives_shallower_prefetch_never_an_error(self):
        unlimited = reorder_for_overlap(
            bucket_by_group(self.graphs()["forward"]), FIXED, memory_budget_bytes=UNLIMITED
        ).meta[SCHEDULE_META]
        depths = {}
        for budget in (unlimited.peak_bytes_after, unlimited.peak_bytes_after - 1, unlimited.peak_bytes_before, 1):
            gm = reorder_for_overlap(bucket_by_group(self.graphs()["forward"]), FIXED, memory_budget_bytes=budget)
            report = gm.meta[SCHEDULE_META]
            peak = simulate(gm, FIXED).memory.peak_bytes
            self.assertEqual(peak, report.peak_bytes_after)
            self.assertLessEqual(peak, max(budget, report.peak_bytes_before))
            depths[budget] = sum(report.prefetch_depth.values())
        self.assertEqual(depths[unlimited.peak_bytes_after], sum(unlimited.prefetch_depth.values()))
        self.assertLess(depths[unlimited.peak_bytes_after - 1], depths[unlimited.peak_bytes_after])
        # Over budget from the start: only moves that do not grow the peak are kept.
        over = reorder_for_overlap(bucket_by_group(self.graphs()["forward"]), FIXED, memory_budget_bytes=1)
        self.assertEqual(over.meta[SCHEDULE_META].peak_bytes_after, over.meta[SCHEDULE_META].peak_bytes_before)

    def test_waits_sink_partway_when_the_budget_allows_no_full_sink(self):
        """At the unscheduled peak no reduce-scatter wait can move to the next reduce-scatter; each
        block's still moves as late as the budget allows (a few compute nodes: some overlap)."""
        gm = bucket_by_group(self.graphs()["backward"])
        before = simulate(gm, FIXED).memory.peak_bytes
        gm = reorder_for_overlap(gm, FIXED, memory_budget_bytes=before)
        simulation = simulate(gm, FIXED)
        self.assertLessEqual(simulation.memory.peak_bytes, before)
        distances = {c.group: c.prefetch_distance for c in simulation.collectives if c.kind == "reduce_scatter"}
        self.assertEqual(distances, {"blocks.2": 1, "blocks.1": 1, "blocks.0": 1, "<root>": 0})

    def test_bytes_in_flight_limit(self):
        limit = _BLOCK_BYTES + _ROOT_BYTES
        for kind in ("forward", "backward"):
            gm = reorder_for_overlap(bucket_by_group(self.graphs()[kind]), FIXED, max_bytes_in_flight=limit)
            self.assertLessEqual(in_flight_bytes(program_of(gm)), limit)
            self.assertLessEqual(gm.meta[SCHEDULE_META].max_in_flight_bytes, limit)

    def test_one_collective_in_flight(self):
        """`max_collectives_in_flight=1`: never two collectives in flight, yet the forward still
        prefetches (AG(i+1) after wait(AG(i)), under compute(i))."""
        for kind in ("forward", "backward"):
            unlimited = reorder_for_overlap(bucket_by_group(self.graphs()[kind]), FIXED, memory_budget_bytes=UNLIMITED)
            self.assertGreater(in_flight(program_of(unlimited))[1], 1)  # the fake group: no limit
            gm = reorder_for_overlap(
                bucket_by_group(self.graphs()[kind]), FIXED, memory_budget_bytes=UNLIMITED, max_collectives_in_flight=1
            )
            self.assertEqual(in_flight(program_of(gm))[1], 1)
            self.assertEqual(gm.meta[SCHEDULE_META].max_in_flight_collectives, 1)
            if kind == "forward":
                report = gm.meta[SCHEDULE_META]
                self.assertLess(report.exposed_s_after, report.exposed_s_before)
                self.assertIn(1, report.prefetch_depth.values())

    def test_simulator_exposes_unscheduled_communication(self):
        forward = self.graphs()["forward"]
        sim = simulate(forward, FIXED)
        # Every all-gather is waited on right after it is issued: all communication is exposed.
        self.assertAlmostEqual(sim.exposed_comm_s, sim.comm_s)
        self.assertAlmostEqual(sim.total_s, sim.compute_s + sim.comm_s)
        self.assertEqual([c.prefetch_distance for c in sim.collectives], [0, 0, 0, 0])

    def test_order_cost_is_the_simulators_for_any_order(self):
        """`OrderCost`, which the reorder pass measures its candidates with, gives what `simulate`,
        `in_flight` and `all_gathers_in_flight` give for the same program, bit for bit, on random
        topological orders of unscheduled and scheduled graphs (so the schedule is the one full
        simulations would pick); see [Note: Measuring candidate orders]."""
        graphs = {**self.graphs(), **{f"embed {k}": g for k, g in capture_graphs(sharded_embed_stack(), torch.randint(0, 256, (4, 8))).items()}}
        for what, graph, graph_ops in cost_cases(graphs):
            cost = OrderCost(graph_ops, FIXED)
            for seed in range(20):
                order = _random_topological_order(list(graph.graph.nodes), seed)
                program = [graph_ops[n] for n in order]
                sim = simulate(program, FIXED)
                expected = (sim.memory.peak_bytes, sim.exposed_comm_s, (*in_flight(program), all_gathers_in_flight(program)))
                self.assertEqual(cost.measure(order), expected, f"{what}, seed {seed}")

    def test_memory_model(self):
        """What [Note: Simulator model] says a step holds: a backward's saved activations until their
        last use, a collective's scratch until its wait, an `out=` collective's output in its buffer."""
        def op(name, kind, inputs=(), out_bytes=0, **kwargs):
            return Op(name, OpKind(kind), name, list(inputs), out_bytes, **kwargs)

        backward = [
            op("primals_1", "input", out_bytes=1000),  # a parameter's shard: the caller's
            op("saved", "input", out_bytes=100),  # an activation the forward saved
            op("tangents_1", "input", out_bytes=10),
            op("grad", "compute", ["saved", "tangents_1"], 40),  # the saved activation's last use
            op("rs", "collective", ["grad"], 20, scratch_bytes=60),
            op("x", "compute", ["primals_1"], 5),
            op("wait", "wait", ["rs"], 20),
            op("buffer", "compute", [], 80),
            op("ag", "collective", ["primals_1", "buffer"], 80, storage_of="buffer"),
            op("wait_ag", "wait", ["ag"], 80),
            op("output", "output", ["wait", "wait_ag", "x"]),
        ]
        self.assertEqual(saved_inputs(backward), frozenset({"saved"}))
        profile = memory_profile(backward)
        # saved 100 + grad 40 at its position; then the reduce-scatter: its input (read until its
        # wait) 40, output 20 and scratch 60, and x 5 before its wait.
        self.assertEqual(profile.live_bytes[:7], [0, 100, 100, 40, 120, 125, 25])
        self.assertEqual((profile.peak_bytes, profile.peak_at), (140, "grad"))
        # The all-gather writes into its buffer: 80 bytes, not 160.
        self.assertEqual(profile.live_bytes[7:10], [105, 105, 105])
        # A forward's inputs are all the caller's.
        forward = [dataclasses.replace(o, name="primals_2") if o.name == "tangents_1" else o for o in backward]
        self.assertEqual(saved_inputs(forward), frozenset())
        self.assertEqual(memory_profile(forward).peak_bytes, 125)

    def test_decisions_do_not_depend_on_the_rank(self):
        first = schedule_lines(reorder_for_overlap(bucket_by_group(self.graphs()["backward"]), FIXED))
        second = schedule_lines(reorder_for_overlap(bucket_by_group(self.graphs()["backward"]), FIXED))
        self.assertEqual(first, second)


def _random_topological_order(nodes: list, seed: int) -> list:
    """`nodes` (placeholders first, the output last) in a random order in which each node follows
    its inputs; seed 0 keeps the graph's own order."""
    if seed == 0:
        return nodes
    import random

    rng = random.Random(seed)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = [n for n in nodes if n.op == "output"]
    placed = set(placeholders)
    waiting = {n: {i for i in n.all_input_nodes if i not in placed} for n in nodes if n.op not in ("placeholder", "output")}
    ready = [n for n, inputs in waiting.items() if not inputs]
    order = list(placeholders)
    while ready:
        n = ready.pop(rng.randrange(len(ready)))
        order.append(n)
        for user in n.users:
            if user in waiting:
                waiting[user].discard(n)
                if not waiting[user] and user not in order and user not in ready:
                    ready.append(user)
    assert len(order) == len(nodes) - len(output)
    return order + output


class TensorParallelSchedulingTest(expecttest.TestCase):
    """FSDP over mesh["dp"] of a (dp=2, tp=2) mesh of 4 fake ranks, with tensor-parallel blocks."""

    def setUp(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self._pg = fake_process_group(4)
        self._pg.__enter__()
        self.mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def tearDown(self) -> None:
        self._pg.__exit__(None, None, None)

    def graphs(self):
        return capture_graphs(tensor_parallel_stack(self.mesh), torch.randn(4, 16))

    @staticmethod
    def fixed_order(gm):
        """The tp collectives and waits with the compute between them: what the passes must keep."""
        lines = schedule_lines(gm).splitlines()
        return [line for line in lines if "[tp]" in line or line == "mm"]

    def test_tp_collectives_stay_put_while_fsdp_overlaps_them(self):
        graphs, scheduled = self.graphs(), {}
        for kind in ("forward", "backward"):
            gm = scheduled[kind] = bucket_by_group(graphs[kind])
            tp = [n for n in gm.graph.nodes if is_collective(n) and not is_fsdp_collective(n)]
            self.assertTrue(tp and all(parallelism_of(n) == "tp" for n in tp), kind)
            before = self.fixed_order(gm)
            gm = scheduled[kind] = reorder_for_overlap(gm, FIXED, memory_budget_bytes=UNLIMITED)
            self.assertEqual(self.fixed_order(gm), before, kind)
            report = gm.meta[SCHEDULE_META]
            self.assertLess(report.exposed_s_after, report.exposed_s_before, kind)
        # The later blocks' all-gathers are issued ahead (FSDP's stream is not tp's, so they run
        # under this block's matmuls and its rowwise all-reduce); tp's own collectives keep their
        # places between the matmuls.
        self.assertExpectedInline(schedule_lines(scheduled["forward"]), """\
AG <root>
AG blocks.0
wait AG <root>
AG blocks.1
wait AG blocks.0
mm
mm
AR [tp]
wait AR [tp]
AG blocks.2
wait AG blocks.1
mm
mm
AR [tp]
wait AR [tp]
wait AG blocks.2
mm
mm
AR [tp]
wait AR [tp]
mm""")
        # Backward: the re-gather of the block before runs under this block's matmuls and its
        # input gradient's all-reduce; reduce-scatter waits sink past the next block's all-reduce.
        self.assertExpectedInline(schedule_lines(scheduled["backward"]), """\
AG blocks.2
mm
mm
mm
AG blocks.1
wait AG blocks.2
mm
mm
mm
AR [tp]
wait AR [tp]
RS blocks.2
mm
AG blocks.0
wait AG blocks.1
mm
mm
mm
AR [tp]
wait AR [tp]
RS blocks.1
wait RS blocks.2
RS <root>
wait RS blocks.1
mm
wait AG blocks.0
mm
mm
RS blocks.0
wait RS <root>
wait RS blocks.0""")
