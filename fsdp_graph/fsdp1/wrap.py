"""FSDP1-style wrapping on top of `fully_shard`: auto-wrap policies and sharding strategies.

FSDP1 (`FullyShardedDataParallel`) decided the groups with an `auto_wrap_policy` and the sharding
with a `ShardingStrategy`. `wrap` applies `fully_shard` bottom-up by such a policy, then to the
root, and returns a plan a person can read; `fully_shard_with_strategy` maps a strategy name to
`fully_shard` arguments.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..api import FSDPModule, fully_shard


class WrapPolicy:
    """Decides which submodules get a group of their own.

    FSDP1's meaning: called with `recurse=True` it says whether to look inside `module`; with
    `recurse=False`, whether to wrap `module`, whose `nonwrapped_numel` parameters are not yet in
    a group of a descendant.
    """

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        raise NotImplementedError


class ModuleWrapPolicy(WrapPolicy):
    """Wrap every module that is an instance of one of `module_classes`."""

    def __init__(self, module_classes: Iterable[type]) -> None:
        classes = tuple(module_classes)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if not classes or bad:
            raise TypeError(f"ModuleWrapPolicy takes nn.Module subclasses, e.g. ModuleWrapPolicy({{Block}}); got {bad or 'nothing'}")
        self.module_classes = classes

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else isinstance(module, self.module_classes)


class SizeBasedWrapPolicy(WrapPolicy):
    """Wrap a module once the parameters not yet wrapped below it reach `min_num_params`."""

    def __init__(self, min_num_params: int) -> None:
        if isinstance(min_num_params, bool) or not isinstance(min_num_params, int) or min_num_params < 1:
            raise ValueError(f"min_num_params must be a positive int, got {min_num_params!r}")
        self.min_num_params = min_num_params

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else nonwrapped_numel >= self.min_num_params


class CustomWrapPolicy(WrapPolicy):
    """A callable `(module, recurse, nonwrapped_numel) -> bool` with FSDP1's meaning."""

    def __init__(self, fn: Callable[[nn.Module, bool, int], bool]) -> None:
        if not callable(fn):
            raise TypeError(f"CustomWrapPolicy takes a callable (module, recurse, nonwrapped_numel) -> bool, got {fn!r}")
        self.fn = fn

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return bool(self.fn(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel))


@dataclass(frozen=True)
class GroupPlan:
    """Attributes:
    fqn: the wrapped module's name ("" for the root).
    num_params: parameter elements in the group.
    num_bytes: their bytes, unsharded.
    """

    fqn: str
    num_params: int
    num_bytes: int


@dataclass(frozen=True)
class WrapPlan:
    """The groups `wrap` made, innermost first, root last.

    Attributes:
        groups: one `GroupPlan` per `fully_shard` call.
    """

    groups: tuple[GroupPlan, ...]

    def __str__(self) -> str:
        lines = [f"{'group':<40}{'params':>14}{'MiB':>10}"]
        for g in self.groups:
            lines.append(f"{g.fqn or '<root>':<40}{g.num_params:>14,}{g.num_bytes / 2**20:>10.2f}")
        total = sum(g.num_params for g in self.groups)
        lines.append(f"{len(self.groups)} groups, {total:,} parameters")
        return "\n".join(lines)


def _is_wrappable(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward and not isinstance(module, FSDPModule)


def _unwrapped_params(module: nn.Module, taken: set[int]) -> list[nn.Parameter]:
    return [p for p in module.parameters() if id(p) not in taken]


def wrap(
    model: nn.Module,
    policy: Union[WrapPolicy, Callable[[nn.Module, bool, int], bool]],
    **fully_shard_kwargs,
) -> tuple[nn.Module, WrapPlan]:
    """Apply `fully_shard` to the submodules `policy` picks (bottom-up), then to `model`.

    Returns the model and its `WrapPlan`. Keyword arguments go to every `fully_shard` call.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap expects an nn.Module, got {type(model).__name__}")
    if not isinstance(policy, WrapPolicy):
        if not callable(policy):
            raise TypeError(
                f"policy must be a WrapPolicy or a callable (module, recurse, nonwrapped_numel); got {policy!r}"
            )
        policy = CustomWrapPolicy(policy)
    groups: list[GroupPlan] = []
    taken: set[int] = set()

    def shard(module: nn.Module, fqn: str) -> None:
        params = _unwrapped_params(module, taken)
        groups.append(GroupPlan(fqn, sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)))
        fully_shard(module, **fully_shard_kwargs)
        taken.update(id(p) for p in module.parameters())  # the DTensors that replaced them

    def visit(module: nn.Module, fqn: str) -> None:
        if not policy(module, True, sum(p.numel() for p in _unwrapped_params(module, taken))):
            return
        for name, child in module.named_children():
            visit(child, f"{fqn}.{name}" if fqn else name)
        remaining = sum(p.numel() for p in _unwrapped_params(module, taken))
        if module is not model and _is_wrappable(module) and remaining and policy(module, False, remaining):
            shard(module, fqn)

    visit(model, "")
    shard(model, "")
    return model, WrapPlan(tuple(groups))


class ShardingStrategy(enum.Enum):
    """FSDP1's strategies and what they mean for `fully_shard`.

    | FSDP1               | fsdp_graph                                        |
    |---------------------|---------------------------------------------------|
    | FULL_SHARD          | reshard_after_forward=True                        |
    | SHARD_GRAD_OP       | reshard_after_forward=False                       |
    | HYBRID_SHARD        | 2-D mesh (replicate, shard), reshard_after_forward=True  |
    | _HYBRID_SHARD_ZERO2 | 2-D mesh (replicate, shard), reshard_after_forward=False |
    | NO_SHARD            | mesh (world, 1): every rank holds everything; gradients all-reduced |
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    HYBRID_SHARD = "HYBRID_SHARD"
    _HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"
    NO_SHARD = "NO_SHARD"


def strategy_kwargs(strategy: Union[ShardingStrategy, str], mesh: Optional[DeviceMesh] = None) -> dict:
    """`fully_shard` keyword arguments (`mesh`, `reshard_after_forward`) for an FSDP1 strategy."""
    if isinstance(strategy, str):
        try:
            strategy = ShardingStrategy[strategy]
        except KeyError:
            raise ValueError(
                f"unknown sharding strategy {strategy!r}; use one of {[s.name for s in ShardingStrategy]}"
            ) from None
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"strategy must be a ShardingStrategy or its name, got {type(strategy).__name__}")
    hybrid = strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    if hybrid and (mesh is None or mesh.ndim != 2):
        raise ValueError(
            f"{strategy.name} needs a 2-D mesh (replicate, shard), e.g. init_device_mesh('cuda', "
            f"(num_nodes, gpus_per_node), mesh_dim_names=('replicate', 'shard')); got {mesh}"
        )
    if strategy is ShardingStrategy.NO_SHARD:
        if mesh is not None and (mesh.ndim != 2 or mesh.size(1) != 1):
            raise ValueError(f"NO_SHARD replicates over all ranks: pass mesh=None or a (world, 1) mesh; got {mesh}")
        if mesh is None:
            device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
            mesh = init_device_mesh(device_type, (dist.get_world_size(), 1))
        return {"mesh": mesh, "reshard_after_forward": False}
    reshard = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
    return {"mesh": mesh, "reshard_after_forward": reshard}


def fully_shard_with_strategy(
    module: nn.Module, strategy: Union[ShardingStrategy, str], mesh: Optional[DeviceMesh] = None, **kwargs
):
    """`fully_shard(module, ...)` with the mesh and resharding an FSDP1 `strategy` stands for."""
    return fully_shard(module, **strategy_kwargs(strategy, mesh), **kwargs)
