"""Graph structure of the compiled step, one process on a fake process group of 8 ranks.

The graphs are read from the backend's own dump (`dump_dir`): the forward and backward graphs the
inner compiler receives. Update the inline graphs with `EXPECTTEST_ACCEPT=1`.
"""

import json
import math
import re
import tempfile
from pathlib import Path

import expecttest
import torch
import torch.nn as nn

import fsdp_graph
from _harness import fake_process_group
from fsdp_graph import MixedPrecisionPolicy, fully_shard


class TwoLayerMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16, bias=False)  # 2 rows per rank
        self.fc2 = nn.Linear(16, 4, bias=False)  # 4 rows over 8 ranks: 1 row, half the ranks pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class CompiledGraphTest(expecttest.TestCase):
    def setUp(self) -> None:
        self._pg = fake_process_group(8)
        self._pg.__enter__()
        torch._dynamo.reset()

    def tearDown(self) -> None:
        self._pg.__exit__(None, None, None)
        # Tests later in this pytest process fork ranks that inherit Dynamo's caches and counters.
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()

    def compile_step(self, backend_options=None, shard=None, **shard_kwargs) -> dict:
        """Shard (fc1, fc2, root; or `shard(model)`), compile with aot_eager, run one step; returns
        the dumped graphs and summary."""
        with tempfile.TemporaryDirectory() as tmp:
            return self._compile_step(Path(tmp), backend_options or {}, shard, shard_kwargs)

    def _compile_step(self, tmp: Path, backend_options: dict, shard, shard_kwargs: dict) -> dict:
        torch.manual_seed(0)
        model = TwoLayerMLP()
        if shard is not None:
            shard(model)
        else:
            fully_shard(model.fc1, **shard_kwargs)
            fully_shard(model.fc2, **shard_kwargs)
            fully_shard(model)
        backend = fsdp_graph.backend(compiler="aot_eager", dump_dir=str(tmp), **backend_options)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        compiled(torch.randn(2, 16)).sum().backward()
        assert model.fc2.weight.grad.placements == model.fc2.weight.placements
        summary = json.loads((tmp / "summary.json").read_text())
        (graph_id,) = summary["graphs"]
        return {
            "forward": (tmp / f"{graph_id}.forward.txt").read_text(),
            "backward": (tmp / f"{graph_id}.backward.txt").read_text(),
            "summary": summary["graphs"][graph_id],
        }

    @staticmethod
    def saved_unsharded_groups(graphs: dict) -> list[str]:
        return [s["group"] for s in graphs["summary"]["forward"]["saved_unsharded"]]

    @staticmethod
    def collectives(graphs: dict) -> str:
        """Collectives in graph order, forward then backward: `forward all_gather_into_tensor fc1`."""
        return "\n".join(
            f"{kind} {c['op']} {c['group']}"
            for kind in ("forward", "backward")
            for c in graphs["summary"][kind]["collectives"]
        )

    def test_reshard_after_forward_regathers_in_backward(self):
        graphs = self.compile_step(reshard_after_forward=True)
        self.assertEqual(self.saved_unsharded_groups(graphs), [])
        self.assertExpectedInline(graphs["forward"], """\
primals_1: float32[2, 16]
primals_2: float32[34]
primals_3: float32[1]
primals_4: float32[18]
primals_5: float32[1]
all_gather_into_tensor = _c10d_functional.all_gather_into_tensor(primals_2, 8, '0') : float32[272]  # fc1 recompute
wait_tensor = _c10d_functional.wait_tensor(all_gather_into_tensor) : float32[272]  # recompute
copy_out = fsdp_graph.copy_out(wait_tensor, 8, [32, 2], [256, 0], 1) :   # recompute
getitem = <built-in function getitem>(copy_out, 0) : float32[256]  # recompute
view = aten.view(getitem, [16, 16]) : float32[16, 16]  # recompute
t = aten.t(view) : float32[16, 16]
mm = aten.mm(primals_1, t) : float32[2, 16]
relu = aten.relu(mm) : float32[2, 16]
all_gather_into_tensor_1 = _c10d_functional.all_gather_into_tensor(primals_4, 8, '0') : float32[144]  # fc2 recompute
wait_tensor_1 = _c10d_functional.wait_tensor(all_gather_into_tensor_1) : float32[144]  # recompute
copy_out_1 = fsdp_graph.copy_out(wait_tensor_1, 8, [16, 2], [64, 0], 1) :   # recompute
getitem_2 = <built-in function getitem>(copy_out_1, 0) : float32[64]  # recompute
view_1 = aten.view(getitem_2, [4, 16]) : float32[4, 16]  # recompute
t_1 = aten.t(view_1) : float32[16, 4]
mm_1 = aten.mm(relu, t_1) : float32[2, 4]
return [mm_1, primals_1, primals_2, primals_4, relu]
""")
        self.assertExpectedInline(graphs["backward"], """\
primals_1: float32[2, 16]
primals_2: float32[34]
primals_4: float32[18]
relu: float32[2, 16]
tangents_1: float32[2, 4]
t_2 = aten.t(tangents_1) : float32[4, 2]
mm_2 = aten.mm(t_2, relu) : float32[4, 16]
t_3 = aten.t(mm_2) : float32[16, 4]
all_gather_into_tensor_1 = _c10d_functional.all_gather_into_tensor(primals_4, 8, '0') : float32[144]  # fc2 recompute
wait_tensor_1 = _c10d_functional.wait_tensor(all_gather_into_tensor_1) : float32[144]  # recompute
copy_out_1 = fsdp_graph.copy_out(wait_tensor_1, 8, [16, 2], [64, 0], 1) :   # recompute
getitem_2 = <built-in function getitem>(copy_out_1, 0) : float32[64]  # recompute
view_1 = aten.view(getitem_2, [4, 16]) : float32[4, 16]  # recompute
t_1 = aten.t(view_1) : float32[16, 4]
t_4 = aten.t(t_1) : float32[4, 16]
mm_3 = aten.mm(tangents_1, t_4) : float32[2, 16]
t_5 = aten.t(t_3) : float32[4, 16]
view_2 = aten.view(t_5, [64]) : float32[64]
pack_grads = fsdp_graph.pack_grads([view_2, None], 8, [16, 2], [64, 0], float32, device(type='cpu'), 1) : float32[144]
reduce_scatter_tensor = _c10d_functional.reduce_scatter_tensor(pack_grads, 'sum', 8, '0') : float32[18]  # fc2
wait_tensor_2 = _c10d_functional.wait_tensor(reduce_scatter_tensor) : float32[18]
div = aten.div.Tensor(wait_tensor_2, 8.0) : float32[18]
detach = aten.detach(relu) : float32[2, 16]
detach_1 = aten.detach(detach) : float32[2, 16]
threshold_backward = aten.threshold_backward(mm_3, detach_1, 0) : float32[2, 16]
t_6 = aten.t(threshold_backward) : float32[16, 2]
mm_4 = aten.mm(t_6, primals_1) : float32[16, 16]
t_7 = aten.t(mm_4) : float32[16, 16]
t_8 = aten.t(t_7) : float32[16, 16]
view_3 = aten.view(t_8, [256]) : float32[256]
pack_grads_1 = fsdp_graph.pack_grads([view_3, None], 8, [32, 2], [256, 0], float32, device(type='cpu'), 1) : float32[272]
reduce_scatter_tensor_1 = _c10d_functional.reduce_scatter_tensor(pack_grads_1, 'sum', 8, '0') : float32[34]  # fc1
wait_tensor_3 = _c10d_functional.wait_tensor(reduce_scatter_tensor_1) : float32[34]
div_1 = aten.div.Tensor(wait_tensor_3, 8.0) : float32[34]
return [None, div_1, None, div, None]
""")

    def test_no_reshard_after_forward_saves_unsharded_and_never_regathers(self):
        graphs = self.compile_step(reshard_after_forward=False)
        # fc1's full weight is not needed in backward (its input needs no gradient); fc2's is kept.
        self.assertEqual(self.saved_unsharded_groups(graphs), ["fc2"])
        self.assertExpectedInline(self.collectives(graphs), """\
forward all_gather_into_tensor fc1
forward all_gather_into_tensor fc2
backward reduce_scatter_tensor fc2
backward reduce_scatter_tensor fc1""")

    def test_reshard_pass_switched_off_keeps_unsharded_like_false(self):
        on = self.compile_step(reshard_after_forward=True)
        off = self.compile_step({"disabled_passes": {"reshard_after_forward"}}, reshard_after_forward=True)
        false = self.compile_step(reshard_after_forward=False)
        self.assertNotEqual(self.collectives(on), self.collectives(off))
        self.assertEqual(self.collectives(off), self.collectives(false))
        self.assertEqual(self.saved_unsharded_groups(off), ["fc2"])

    def test_mixed_precision_casts_are_graph_nodes(self):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        graphs = self.compile_step(reshard_after_forward=True, mp_policy=policy)
        forward, backward = graphs["forward"], graphs["backward"]
        # The cast reads the group's shard buffer (a graph input: no copy-in) and feeds the all-gather.
        self.assertRegex(forward, r"_to_copy = aten._to_copy\(primals_\d+, dtype=bfloat16\).*\n.*all_gather_into_tensor\(_to_copy,")
        self.assertEqual(re.findall(r"all_gather_into_tensor\(.*: (\w+)\[", forward), ["bfloat16", "bfloat16"])
        self.assertEqual(re.findall(r"reduce_scatter_tensor\(.*: (\w+)\[", backward), ["float32", "float32"])

    def test_int_reshard_after_forward_regathers_from_the_full_group(self):
        # The eager runtime keeps a 1/2 slice and re-gathers over 2 ranks; a graph re-gathers over
        # the whole shard group instead, which gives the same numbers.
        self.assertEqual(
            self.collectives(self.compile_step(reshard_after_forward=2)),
            self.collectives(self.compile_step(reshard_after_forward=True)),
        )

    def test_frozen_parameters_are_gathered_but_not_reduced(self):
        def shard(model):
            model.fc1.weight.requires_grad_(False)  # LoRA-style: frozen and trainable in one group
            fully_shard(model)

        graphs = self.compile_step(shard=shard)
        sizes = {(kind, c["op"]): c["bytes"] for kind in ("forward", "backward") for c in graphs["summary"][kind]["collectives"]}
        # Per rank: fc1 2 rows x 16, fc2 1 row x 16 (4 rows padded to 8), fp32, and fc2's gradient
        # flag with a zero column beside it (an even number: [Note: An even number of flag
        # columns]). The all-gather brings all to all 8 ranks; the reduce-scatter carries fc2's
        # row and the flags' columns only.
        self.assertEqual(sizes, {("forward", "all_gather_into_tensor"): 8 * (32 + 16 + 2) * 4,
                                 ("backward", "reduce_scatter_tensor"): (16 + 2) * 4})

    def test_group_of_several_parameters_copies_in_and_out_in_one_op(self):
        """One group (fc1, fc2): no `copy_in` (the all-gather reads the group's shard buffer), one
        `copy_out` per gather and one `pack_grads` per reduce-scatter, no per-parameter slicing for
        Inductor to turn into kernels."""
        graphs = self.compile_step(shard=lambda model: fully_shard(model))
        ops = {kind: re.findall(r"= (fsdp_graph\.\w+|aten\.slice\w*)", graphs[kind]) for kind in ("forward", "backward")}
        # The root keeps its parameters for backward (no re-gather). The reduced shard is the
        # gradient of the group's row as it is ([Note: Compiled gradients arrive as the row's]),
        # sliced for no parameter; the forward uses both, so the flags get no gradient and no slice
        # ([Note: Flags that need no reading]).
        self.assertEqual(ops, {"forward": ["fsdp_graph.copy_out"], "backward": ["fsdp_graph.pack_grads"]})


def _bucket(tensors, world: int) -> torch.Tensor:
    """The gathered layout built independently: rank r's row holds rows [r * pad, (r + 1) * pad) of
    each tensor, zero-padded, flattened, one tensor after the other."""
    rows = []
    for r in range(world):
        pieces = []
        for t in tensors:
            pad = -(-t.shape[0] // world)
            padded = torch.cat([t, t.new_zeros(world * pad - t.shape[0], *t.shape[1:])])
            pieces.append(padded[r * pad : (r + 1) * pad].reshape(-1))
        rows.append(torch.cat(pieces))
    return torch.cat(rows)


def test_copy_in_copy_out_and_pack_grads_match_the_bucket_layout():
    world = 4
    params = [torch.randn(5, 3), torch.randn(4), torch.randn(1, 7), torch.randn(0, 2)]
    # The gradient flags ride after the trainable parameters, one column per parameter.
    flags = torch.zeros(world, len(params))
    shard_numels = [-(-p.shape[0] // world) * math.prod(p.shape[1:]) for p in params] + [len(params)]
    numels = [p.numel() for p in params] + [0]
    flags_at = len(params)
    gathered = _bucket(params + [flags], world).requires_grad_(True)
    # copy_in builds rank r's row from rank r's shards (rows [r * pad, (r + 1) * pad) of each).
    r = 2
    shards = [p[r * (-(-p.shape[0] // world)) : (r + 1) * (-(-p.shape[0] // world))].reshape(-1) for p in params]
    row = torch.ops.fsdp_graph.copy_in(shards + [flags[r]], shard_numels)
    assert torch.equal(row, gathered.detach().view(world, -1)[r])
    out = torch.ops.fsdp_graph.copy_out(gathered, world, shard_numels, numels, flags_at)
    assert out[flags_at].numel() == 0
    for got, p in zip(out, params):
        assert torch.equal(got.view(p.shape), p)
    grads = [torch.randn_like(p) for p in params]
    grads[1] = None  # an output without gradient counts as zeros, and its flag is 0
    packed = torch.ops.fsdp_graph.pack_grads(
        grads + [None], world, shard_numels, numels, torch.float32, torch.device("cpu"), flags_at
    )
    expected_flags = torch.tensor([1.0, 0.0, 1.0, 1.0]).expand(world, -1)
    zeros_for_none = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]
    expected = _bucket(zeros_for_none + [expected_flags], world)
    assert torch.equal(packed, expected)
    # copy_out's autograd formula is pack_grads; an unused output reaches it as None, not zeros.
    loss = sum((o.view(p.shape) * g).sum() for o, p, g in zip(out, params, grads) if g is not None)
    (grad,) = torch.autograd.grad(loss, gathered)
    assert torch.equal(grad, expected)
