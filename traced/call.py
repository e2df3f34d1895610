"""A sharded module's call while Dynamo traces it: into the step's graph (inline, or as a compile
region), or out of it onto the eager hooks (block scope, a compile region of the user's that reads
the group's parameters, a group that must stay on the eager hooks). `FSDPModule.__call__`
(fsdp_graph/api/module.py) hands every traced call here.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from . import hooks
from .kinds import seen
from .regions import call_as_region, flat_call
from .scope import traced_regions, traced_scope


def traced_call(module: nn.Module, args: tuple, kwargs: dict):
    """A module call while Dynamo traces: inside the step's graph, or one of the ways out of it
    (groups that stay on the eager hooks leave in `FSDPModule.__call__`)."""
    if traced_scope() == "block":
        return _call_in_block_scope(module, args, kwargs)  # [Note: Compile scope] in traced/scope.py
    if module._fsdp_state.hooks_around_compiled_body is not None:
        if module._fsdp_state.traces_as_region():
            return call_as_region(module, *flat_call(args, kwargs), every_block=False)  # [Note: Blocks as compile regions]
        return _call_around_compiled_body(module, args, kwargs)  # [Note: Compile regions under fully_shard]
    if traced_regions() == "blocks" and module._fsdp_state.traces_as_region(every_block=True):
        layout, leaves = flat_call(args, kwargs)
        if seen(module._fsdp_state.region_id, layout):  # a block of its kind traced inline already
            return call_as_region(module, layout, leaves, every_block=True)  # [Note: Every block a compile region]
    return _call_hooks_and_forward(module, args, kwargs)


def _call_hooks_and_forward(module: nn.Module, args: tuple, kwargs: dict):
    """`nn.Module.__call__`, except that the compiled call `FSDPModule.compile` installed is not
    entered again: it is what runs now, or what the eager helpers below step out of. Those that
    leave the rest of the call to Dynamo (`recursive=False`) spell the same line out: a call
    through this function would be a frame of ours, which Dynamo would trace."""
    call = nn.Module._call_impl if module._fsdp_state.compiled_in_place else nn.Module.__call__
    return call(module, *args, **kwargs)


@functools.partial(torch._dynamo.disable, recursive=False)
def call_on_eager_hooks(module: nn.Module, args: tuple, kwargs: dict):
    state = module._fsdp_state
    call = nn.Module._call_impl if state.compiled_in_place else nn.Module.__call__
    output = call(module, *args, **kwargs)
    hooks.record_fallback(state)  # after the call: a root's first call claims its `ctx`
    return output


# [Note: Compile regions under fully_shard]
# A `torch.compiler.nested_compile_region` is traced once and reused by Dynamo, which needs every
# tensor the region reads to come from a source it can guard. Parameters gathered inside the graph
# have none (Dynamo stops with "Freevar has no source"). So a sharded module whose parameters such a
# region reads is not traced into the step's graph: its call is a graph break (this function is
# disabled for its own frame only), its hooks run on the eager runtime, and Dynamo compiles what
# the call reaches, the module's forward with its regions, as frames of their own, once for every
# block of the same code. That is what torch's fully_shard does for every module under compile; the
# numbers are the eager runtime's. Calls that enclose this one are broken up around it, so the root
# runs on the eager hooks too. tests/test_compile_blocks.py compares with torch's fully_shard.
# Where the region is the forward of the group's one module, the region can take the gathered
# tensors as its arguments instead, and the block stays in the step's graph: [Note: Blocks as
# compile regions] in traced/regions.py (`FSDPState.traces_as_region`).
@functools.partial(torch._dynamo.disable, recursive=False)
def _call_around_compiled_body(module: nn.Module, args: tuple, kwargs: dict):
    call = nn.Module._call_impl if module._fsdp_state.compiled_in_place else nn.Module.__call__
    return call(module, *args, **kwargs)


@functools.partial(torch._dynamo.disable, recursive=False)
def _call_in_block_scope(module: nn.Module, args: tuple, kwargs: dict):
    state = module._fsdp_state
    state.calling_in_block_scope = True  # its eager hooks are the plan, not a fallback
    try:
        with state.owner_checks_lifted():  # [Note: Owner checks in block scope] in traced/state.py
            call = nn.Module._call_impl if state.compiled_in_place else nn.Module.__call__
            return call(module, *args, **kwargs)
    finally:
        state.calling_in_block_scope = False


hooks.skip_own_frame(call_on_eager_hooks, _call_around_compiled_body, _call_in_block_scope)


