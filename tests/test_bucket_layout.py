"""One bucket layout for eager and traced steps (issue #47): a group's `BucketLayout`, and the
registered ops both paths call, so both put the same bytes on the wire. See [Note: One bucket layout
for eager and traced steps] in runtime/bucket_layout.py.
"""

import copy
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_graph
from _harness import fake_process_group, run_ranks
from _models import MLPStack
from fsdp_graph import fully_shard
from fsdp_graph.traced import hooks as traced
from fsdp_graph.runtime.bucket_layout import FLAGS

LAYOUT_OPS = {"fsdp_graph::copy_in", "fsdp_graph::copy_out", "fsdp_graph::pack_grads"}


def _shard_mlp(model):
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _layout_ops_of_a_step(model, x) -> set[str]:
    with torch.profiler.profile() as prof:
        model(x).sum().backward()
    return {e.name for e in prof.events() if e.name in LAYOUT_OPS}


def _profiled_layout_ops(rank, world_size):
    x = torch.randn(4, 13, generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    eager = _shard_mlp(MLPStack())
    torch.manual_seed(0)
    compiled = torch.compile(_shard_mlp(MLPStack()), backend=fsdp_graph.backend(compiler="aot_eager"))
    compiled(x).sum().backward()  # compiles
    return _layout_ops_of_a_step(eager, x), _layout_ops_of_a_step(compiled, x)


def test_an_eager_step_runs_the_registered_ops_the_compiled_graph_runs():
    eager, compiled = run_ranks(_profiled_layout_ops, 2)
    # Neither copies in: both gather the group's shard buffer, which the shards are views of
    # ([Note: Sharded parameters live in their group's row] in runtime/shard_buffer.py).
    assert eager == LAYOUT_OPS - {"fsdp_graph::copy_in"}
    assert compiled == LAYOUT_OPS - {"fsdp_graph::copy_in"}


class Mixed(nn.Module):
    """One group: trainable and frozen parameters of uneven sizes (5, 3 and 7 rows over 2 ranks),
    one sharded on dim 1, one used only on rank 1 and one never, so the flags differ by rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(5, 3))  # trainable
        self.frozen = nn.Parameter(torch.randn(3, 3), requires_grad=False)
        self.b = nn.Parameter(torch.randn(7))  # trainable, 1-D
        self.c = nn.Parameter(torch.randn(3, 5))  # trainable, Shard(1)
        self.rank1_only = nn.Parameter(torch.randn(3))  # trainable, a gradient on rank 1 only
        self.unused = nn.Parameter(torch.randn(2, 2))  # trainable, never a gradient
        self.frozen_1d = nn.Parameter(torch.randn(1), requires_grad=False)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(x @ self.frozen) * self.frozen_1d  # (n, 3)
        h = torch.tanh(h @ self.a.t()) @ self.c.t()  # (n, 5), then (n, 3)
        out = (h * self.b[:3]).sum(-1) + self.b[3:].sum()
        if rank == 1:
            out = out + (x * self.rank1_only).sum(-1)
        return out


def _place(param):
    return Shard(1) if param.shape == (3, 5) else Shard(0)


class _WireCapture(TorchDispatchMode):
    """Each collective's input as it is issued: the eager runtime's c10d ops, the traced path's
    functional ones."""

    INPUTS = {  # op -> (kind, the input's position)
        "c10d::_allgather_base_": ("all_gather", 1),
        "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
        "_c10d_functional::all_gather_into_tensor": ("all_gather", 0),
        "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0),
    }

    def __init__(self) -> None:
        super().__init__()
        self.inputs: dict[str, list[torch.Tensor]] = {"all_gather": [], "reduce_scatter": []}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        found = self.INPUTS.get(func.name())
        if found is not None:
            kind, position = found
            self.inputs[kind].append(args[position].detach().clone())
        return func(*args, **(kwargs or {}))


def _expected_rows(tensors: list, world: int, rank: int, dims: list[int]) -> torch.Tensor:
    """Independently of the runtime: rank `rank`'s row of a bucket of `tensors` (None: zeros of
    the flags' width, given as an int) in order, each with its shard dim moved first, zero-padded
    to `world` equal slices of rows."""
    pieces = []
    for t, dim in zip(tensors, dims):
        if isinstance(t, int):  # the flags' block
            pieces.append(torch.zeros(t))
            continue
        moved = t.movedim(dim, 0)
        rows = math.ceil(moved.shape[0] / world)
        padded = torch.cat([moved, moved.new_zeros(world * rows - moved.shape[0], *moved.shape[1:])])
        pieces.append(padded[rank * rows : (rank + 1) * rows].reshape(-1))
    return torch.cat(pieces)


def _wire_bytes(rank, world_size):
    torch.manual_seed(0)
    reference = Mixed()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + rank))
    models = {name: copy.deepcopy(reference) for name in ("eager", "traced")}
    for model in models.values():
        fully_shard(model, shard_placement_fn=_place)
    captured = {}

    eager = models["eager"]
    with _WireCapture() as capture:
        eager(x, rank).sum().backward()
    captured["eager"] = capture.inputs

    # The traced path's code, run outside Dynamo: what Dynamo traces into the graph, with real
    # tensors and the functional collectives run eagerly.
    model = models["traced"]
    state = model._fsdp_state
    with _WireCapture() as capture:
        args, kwargs = traced.pre_forward(state, model, (x, rank), {})
        out = traced.post_forward(state, model, model.forward(*args, **kwargs))
        out.sum().backward()
    captured["traced"] = capture.inputs

    # The independent computation: the unsharded model's parameters and this rank's gradients.
    reference(x, rank).sum().backward()
    names = [name for name, _ in reference.named_parameters()]
    params = dict(reference.named_parameters())
    dims = {name: 1 if name == "c" else 0 for name in names}
    trainable = [n for n in names if params[n].requires_grad]
    frozen = [n for n in names if not params[n].requires_grad]
    order = trainable + [None] + frozen  # the flags between them
    # One flag column per trainable parameter, plus a zero column to make them even
    # ([Note: An even number of flag columns]): 5 here, so 6.
    flag_width = len(trainable) + len(trainable) % 2
    all_gather = _expected_rows(
        [flag_width if n is None else params[n].detach() for n in order], world_size, rank,
        [0 if n is None else dims[n] for n in order],
    )
    grads = [params[n].grad if params[n].grad is not None else torch.zeros_like(params[n]) for n in trainable]
    flags = torch.tensor([float(params[n].grad is not None) for n in trainable])
    grad_dims = [dims[n] for n in trainable]
    padded_flags = torch.cat([flags, flags.new_zeros(flag_width - len(flags))])
    reduce_scatter = torch.cat(
        [torch.cat([_expected_rows(grads, world_size, r, grad_dims), padded_flags]) for r in range(world_size)]
    )
    layout = eager._fsdp_state.group.layout
    return captured, all_gather, reduce_scatter, flags, (layout.blocks, layout.widths, layout.reduce_widths)


def test_eager_and_traced_paths_put_the_same_bytes_on_the_wire():
    """A group of trainable and frozen parameters, uneven, one on dim 1, flags that differ by rank:
    the eager runtime and the traced path issue one all-gather and one reduce-scatter each, with
    inputs equal bit for bit to each other and to the layout computed here from the unsharded model."""
    captured, all_gather, reduce_scatter, flags, layout = run_ranks(_wire_bytes, 2)
    # a, b, c, rank1_only, unused; the flags; frozen, frozen_1d (group order: a, frozen, b, c, ...)
    assert layout == ((0, 2, 3, 4, 5, FLAGS, 1, 6), (9, 4, 9, 2, 2, 6, 6, 1), (9, 4, 9, 2, 2, 6))
    assert flags.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]  # rank 0: rank1_only and unused had none
    for path in ("eager", "traced"):
        (gathered,), (packed,) = captured[path]["all_gather"], captured[path]["reduce_scatter"]
        assert torch.equal(gathered, all_gather), path
        assert torch.equal(packed, reduce_scatter), path


def test_one_layout_per_group_rebuilt_only_when_its_parameters_change():
    """[Note: Parameters changed after fully_shard]: the layout object is kept from step to step
    and rebuilt when a parameter is frozen, converted or unfrozen."""
    with fake_process_group(2):
        model = fully_shard(Mixed(), shard_placement_fn=_place)
        group = model._fsdp_state.group
        x = torch.randn(4, 3)
        layouts = []
        for change in (None, None, lambda: model.b.requires_grad_(False), lambda: model.double(), None):
            if change is not None:
                change()
            model(x.to(model.a.dtype), 0).sum().backward()
            layouts.append(group.layout)
    assert layouts[0] is layouts[1]
    assert layouts[2] is not layouts[1] and layouts[2].reduced == (0, 3, 4, 5)
    assert layouts[3] is not layouts[2] and layouts[3].dtype == torch.float64
    assert layouts[4] is layouts[3]


class _HostTensorsRead(TorchDispatchMode):
    """The ops that read a tensor on the host (CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in leaves):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_gradient_packing_on_a_device_makes_nothing_on_the_host():
    # A tensor made on the host and copied to a GPU (a pageable copy) makes the host wait for the
    # device: in every group's backward, when the packing built its gradient flags that way. The
    # packing's kernel, on fake CUDA tensors (no GPU needed), must read no host tensor.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_graph.runtime.bucket_layout import _pack_grads_out

    with FakeTensorMode():
        grads = [torch.ones(4, device="cuda"), None, torch.ones(6, device="cuda"), None]  # the last: the flags' block
        out = torch.empty(2 * (2 + 2 + 3 + 3), device="cuda")
        with _HostTensorsRead() as read:
            _pack_grads_out(grads, 2, [2, 2, 3, 3], [4, 4, 6, 0], 3, out=out)
    assert read.ops == []
