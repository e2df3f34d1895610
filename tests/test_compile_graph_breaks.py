"""A transformer whose forward loops over its blocks compiles to one graph per step, collectives in it.

One process, fake process group of 8 ranks. `explain()` can report 0 breaks while Dynamo skipped
frames, so this counts `torch._dynamo.utils.counters` and looks at the graphs themselves.
"""

import tempfile

import torch
from torch._dynamo.utils import counters

import fsdp_graph
from _compile_helpers import collective_groups, dumped_graphs
from _harness import fake_process_group
from _models import shard_llama, tiny_llama
from fsdp_graph import fully_shard


def test_transformer_step_is_one_graph_with_every_collective():
    num_layers = 3
    with fake_process_group(8), tempfile.TemporaryDirectory() as tmp:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = shard_llama(tiny_llama(num_layers), fully_shard)
        compiled = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager", dump_dir=tmp))
        tokens = torch.randint(0, 64, (2, 8))
        for _ in range(3):
            compiled(tokens).sum().backward()

        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        assert counters["stats"]["calls_captured"] > 0
        assert model._fsdp_state.ctx.fallbacks == {}

        graphs = dumped_graphs(tmp)
        groups = [f"layers.{i}" for i in range(num_layers)] + ["<root>"]

        def ops(kind, op):
            return collective_groups(graphs, kind, op)

        # Forward: the root (embedding, norm, head) first, then each block in order.
        assert ops("forward", "all_gather_into_tensor") == ["<root>"] + groups[:-1]
        # Backward: blocks re-gather (they reshard after forward), the root does not; every group's
        # gradient is reduce-scattered once, last block first, the root (whose embedding gradient
        # is the last one computed) at the end.
        assert ops("backward", "all_gather_into_tensor") == groups[:-1][::-1]
        assert ops("backward", "reduce_scatter_tensor") == groups[::-1][1:] + ["<root>"]
        assert graphs["forward"]["saved_unsharded"] != []  # the root's, kept for backward
        assert {s["group"] for s in graphs["forward"]["saved_unsharded"]} == {"<root>"}
        # Tests later in this pytest process fork ranks that inherit Dynamo's caches and counters.
        torch._dynamo.reset()
        counters.clear()
