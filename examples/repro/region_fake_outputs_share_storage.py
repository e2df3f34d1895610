"""Torch alone: two calls of one compile region in a training graph get the very same fake tensors
as outputs, so outputs of different calls share a fake storage where the real ones do not.

`body(x, w) = relu(x @ w)` is a `torch.compiler.nested_compile_region`, called on two inputs with one
weight. In the partitioned forward graph each call hands back its output and what its backward needs
(its `x`, `w` and `relu`'s result). The script groups the calls' outputs by their fake value's
storage (`node.meta["val"]`), then runs the forward graph on real tensors and counts the storages
the same outputs really have. Prints, per shared fake storage, the outputs on it and how many real
storages they are: 1 for the weight (really the same tensor), 2 for the others.

    python examples/repro/region_fake_outputs_share_storage.py
"""

import operator

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.multiprocessing.reductions import StorageWeakRef


@torch.compiler.nested_compile_region
def body(x, w):
    return torch.relu(x @ w)


def step(x1, x2, w):
    return body(x1, w).sum() + body(x2, w).sum()


def main() -> None:
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    args = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    torch.compile(step, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))(*args).backward()
    forward = graphs[0]
    by_storage: dict[StorageWeakRef, list] = {}
    for node in forward.graph.nodes:
        if node.target is operator.getitem:
            by_storage.setdefault(StorageWeakRef(node.meta["val"].untyped_storage()), []).append(node)
    returned = {node: i for i, node in enumerate(forward.graph.output_node().args[0])}
    real = forward(*[torch.randn(8, 8) for _ in range(3)])
    for nodes in by_storage.values():
        if len(nodes) < 2:
            continue
        names = [f"{n.name} (output {n.args[1]} of {n.args[0].name})" for n in nodes]
        storages = {real[returned[n]].untyped_storage().data_ptr() for n in nodes if n in returned}
        print(f"one fake storage: {', '.join(names)}; real storages: {len(storages)}")


if __name__ == "__main__":
    main()
