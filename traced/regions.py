"""Sharded blocks traced as compile regions inside the step's graph: the region function every
block runs through, its flat arguments, and the gathered tensors swapped into the block's owners.
Which blocks qualify is the state's question (`TracedState.traces_as_region`), which blocks are
of one kind traced/kinds.py's.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from ..runtime.param_group import ParamGroup
from . import hooks


# [Note: Blocks as compile regions]
# A block whose forward the user marked `torch.compiler.nested_compile_region` (torch's way to say
# "the same code, compile it once") is traced as such a region inside the whole-step graph: Dynamo,
# AOTAutograd's partitioner and Inductor then handle its body once for all blocks of the same code
# and shapes, so compiling a deep model no longer costs every layer again (docs/compiler.md, Compile
# cost). The group's collectives stay outside the region, in the step's graph, where the passes
# bucket, reorder and reshard them as for any other block:
#
#     params = unshard(group)                      # traced as usual: copy-in, all-gather, copy-out
#     out    = region(module, params, args, kwargs)   # invoke_subgraph; swaps `params` in itself
#
# Dynamo cannot trace a region that reads tensors with no source (parameters gathered in the graph),
# so the gathered tensors go in as the region's arguments, and the region swaps them into the
# owners' parameter slots for the forward's duration, with torch's own `_reparametrize_module` (what
# `torch.func.functional_call` uses), once per owning submodule. Dynamo counts those swaps as no
# side effect, so the region is reusable: having traced one block's region, Dynamo checks the next
# block against that trace's guards, moved onto the next block's attributes, and where they hold it
# emits the same body without tracing the block's code again (torch's "subgraph reuse"). A block
# whose forward reads something of its own that differs (a Python number, a flag) fails them and is
# traced anew; `_REGION_ENTRIES` below lifts torch's limit of 8 such bodies.
# Writing the gathered tensors into the owners' attributes ourselves, as the inline path does
# (`install`), is a side effect, and Dynamo then traced every block's region again. The owners are
# found by path (`FSDPState.region_owners`, constants Dynamo can compare between blocks), so every
# owner must lie inside the module. The partitioner then saves a region's inputs
# rather than views of them, and the outer graph reads such an input directly, so the backward
# gathers again after a resharding forward (passes/reshard.py, `save_inputs_not_their_views`).
# Only a block that is a group of its own, holds no other group, has no forward hooks besides ours,
# and gathers plain tensors (no tensor-parallel DTensors or all-gather extension subclasses, which
# Dynamo does not take as region inputs) is traced so; any other marked module keeps [Note: Compile
# regions under fully_shard].
# Dynamo refuses a graph break inside a region (torch raises): such a block must not be marked.
# Compiled in pieces (the backend's default), the graph's regions are inlined once our passes have
# scheduled it, and Inductor compiles each repeated piece once, as without regions ([Note: Pieces
# between the collectives] in fsdp_graph/compile/pieces.py): what the regions save is Dynamo's and
# AOTAutograd's tracing of every block.


# Distinct region bodies Dynamo keeps for `_forward_region` in one trace, all kinds of block
# together (torch raises beyond it; its default is 8): [Note: Blocks as compile regions].
_REGION_ENTRIES = 4096


@torch.compiler.nested_compile_region(max_reuse_entries=_REGION_ENTRIES)
def _forward_region(module: nn.Module, every_block: bool, layout: str, *leaves):
    """A block's forward as one compile region over its gathered parameters ([Note: Blocks as
    compile regions] in traced/regions.py): one function for every block, so that Dynamo compares
    each block's body with those it traced before and keeps one copy of each distinct body. The
    arguments come flat, `layout` telling how to rebuild them (`flat_call`)."""
    state = module._fsdp_state
    unsharded, args, kwargs = _rebuild(layout, leaves)
    output = _with_owners(module, state.region_owners, 0, unsharded, state.region_body(every_block), args, kwargs)
    return _not_an_input(output, leaves)


def _not_an_input(output, inputs: tuple):
    """The region's output, where it hands back one of its inputs (a block that passes a mask
    through) or a view of one, a copy of it: torch refuses a region whose output aliases an input.
    Tensors at the top level and in a tuple or list; Dynamo traces this once per region body, not
    per block (`_base` is the tensor a view was made from, its root base for a view of a view)."""
    if isinstance(output, torch.Tensor):
        base = output._base
        aliases = any(
            output is value or (base is not None and (base is value or base is value._base))
            for value in inputs if isinstance(value, torch.Tensor)
        )
        return output.clone() if aliases else output
    if type(output) in (tuple, list):
        return type(output)(_not_an_input(value, inputs) if isinstance(value, torch.Tensor) else value for value in output)
    return output


def _with_owners(module: nn.Module, owners: tuple, at: int, unsharded: list, body: Callable, args, kwargs):
    """`body(module, *args, **kwargs)` with the gathered tensors swapped into the owners from
    `owners[at]` on, one owner per nested swap, which Dynamo takes as no side effect ([Note: Blocks
    as compile regions] in traced/regions.py)."""
    if at == len(owners):
        return body(module, *args, **kwargs)
    path, names = owners[at]
    with torch.nn.utils.stateless._reparametrize_module(module.get_submodule(path), {name: unsharded[i] for name, i in names}):
        return _with_owners(module, owners, at + 1, unsharded, body, args, kwargs)


def call_as_region(module: nn.Module, layout: str, leaves: list, every_block: bool):
    """The call, its arguments flat (`flat_call`), as a region over the gathered tensors."""
    state = module._fsdp_state
    unsharded, leaves = hooks.region_pre_forward(state, leaves)
    layout = ";".join([str(len(unsharded)), layout]) if layout else str(len(unsharded))
    return hooks.region_post_forward(state, _forward_region(module, every_block, layout, *unsharded, *leaves))


# [Note: Every block a compile region]
# `fsdp_graph.backend(regions="blocks")` traces sharded blocks as if their forward were marked
# `torch.compiler.nested_compile_region` ([Note: Blocks as compile regions] in traced/regions.py),
# with no change to the model's classes: a block that is a group of its own and qualifies there
# (no forward hooks of the user's, no forward set on the instance, plain tensors gathered) runs its
# class's forward as a region, the collectives outside it, once the trace has traced one block of
# its kind inline. The whole step's graph then holds one region body per kind, which Dynamo traces
# once and AOTAutograd once: what each further layer costs is tracing the collectives around it.
# The first block of a kind goes inline because Dynamo refuses a graph break inside a region
# (torch raises): a block that breaks the graph breaks it inline first, and then runs on the eager
# hooks as it would without regions (the trace that continues after the break is a new one, whose
# first block of that kind again goes inline). So the kind holds what a block's code may branch on:
# `kind_of` in traced/kinds.py (classes, the Python flags of every submodule: bools, strings, None,
# enums; parameter shapes), read from the block at the call, and the layout of the call's
# arguments. Blocks that differ there (Gemma's sliding and global layers) are kinds apart, each
# with its first block inline. Numbers join the kind only where the kind's first block's trace
# guarded on them ([Note: Numbers a block's trace guarded on]): a layer index differs in every
# block, and most code never reads it. A later block whose code branches on global state, or on a
# number passed in as an argument, into a graph break still meets torch's error inside its region,
# which Dynamo raises out of the compiled call before any code of ours runs. Torch refuses outputs
# that alias inputs: an input handed back as it is, or a view of one, gets copied
# (`_not_an_input`). What AOTAutograd refuses in a region, a buffer or input changed in place,
# compiles inline instead: [Note: Regions that do not compile] in fsdp_graph/compile/backend.py.
# Region blocks reshard after forward, stay unsharded, or are kept by a memory budget's selective
# unsharding as inline blocks are (tests/test_compile_blocks.py).
# `seen` (traced/kinds.py) keeps its record per trace: Dynamo runs it as plain Python while tracing
# (`assume_constant_result`), and a restarted trace (a graph break found) starts a new record.


# [Note: Flat region arguments]
# Dynamo flattens a region's arguments to compare calls; nested ones (a list of tensors, a dict of
# keyword arguments) go through pytree, whose traced code costs every call and leaves a guard on
# pytree's registry that torch 2.13 cannot serialize (fsdp_graph.precompile then gives up). So the
# gathered tensors and the call's arguments go in flat, with a string constant that says how to
# rebuild them: "n;a:;a2:;k:name;k2:name" = n gathered tensors, a positional leaf, a positional
# tuple of 2 leaves, a keyword leaf, a keyword tuple of 2 leaves. Leaves are tensors and Python
# scalars; anything else (a cache object, a nested structure) goes in as it is, as "oa:" or "ok:name".


_LEAF_TYPES = (torch.Tensor, bool, int, float, str, type(None))


def flat_call(args: tuple, kwargs: dict) -> tuple[str, list]:
    """A call's arguments as (the layout of their fields, the leaves); the region's layout puts the
    number of gathered tensors first. One loop with no calls of ours in it: Dynamo steps through it
    at every block's call."""
    fields, leaves = [], []
    values, names, positional = (*args, *kwargs.values()), ("",) * len(args) + tuple(kwargs), len(args)
    for i in range(len(values)):
        value, kind = values[i], "a" if i < positional else "k"
        if isinstance(value, _LEAF_TYPES):
            fields.append(f"{kind}:{names[i]}")
            leaves.append(value)
            continue
        flat = type(value) is tuple
        if flat:
            for item in value:
                flat = flat and isinstance(item, _LEAF_TYPES)
        if flat:
            fields.append(f"{kind}{len(value)}:{names[i]}")
            leaves.extend(value)
        else:
            fields.append(f"o{kind}:{names[i]}")
            leaves.append(value)
    return ";".join(fields), leaves


def _rebuild(layout: str, leaves: tuple) -> tuple[list, list, dict]:
    fields = layout.split(";")
    n = int(fields[0])
    unsharded, args, kwargs, at = list(leaves[:n]), [], {}, n
    for field in fields[1:]:
        kind, _, name = field.partition(":")
        count = kind.lstrip("oak")
        if count:
            value, at = tuple(leaves[at:at + int(count)]), at + int(count)
        else:
            value, at = leaves[at], at + 1
        if "a" in kind:
            args.append(value)
        else:
            kwargs[name] = value
    return unsharded, args, kwargs


# -- regions the user marked -----------------------------------------------------------------------

def region_reading_reason(modules: tuple[nn.Module, ...], group: Optional[ParamGroup]) -> Optional[str]:
    """Why compiled calls must run the hooks around a body compiled on its own, or None: a module
    whose forward is a `torch.compiler.nested_compile_region` reads parameters of this group
    ([Note: Compile regions under fully_shard] in traced/call.py)."""
    if group is None:
        return None
    owner_ids = {id(owner) for p in group.params for owner, _ in p.owners}
    for root in modules:
        for name, sub in root.named_modules():
            marked = _region_fn(getattr(sub, "forward", None))
            if marked is not None and any(id(m) in owner_ids for m in sub.modules()):
                where = f"{type(sub).__name__}.forward" + (f" (submodule '{name}')" if name else "")
                return (
                    f"{where} is a torch.compiler.nested_compile_region reading parameters this group "
                    f"gathers: the module's hooks ran on the eager runtime around its forward, which "
                    f"Dynamo compiled on its own (as under torch's fully_shard)"
                )
    return None


def own_region_forward(modules: tuple[nn.Module, ...]) -> Optional[Callable]:
    """The function under a `torch.compiler.nested_compile_region` that is the forward of the one
    module of this group, or None ([Note: Blocks as compile regions] in traced/regions.py)."""
    if len(modules) != 1 or "forward" in modules[0].__dict__:
        return None
    return _region_fn(type(modules[0]).forward)


def _region_fn(forward) -> Optional[Callable]:
    """The innermost function under `torch.compiler.nested_compile_region` wrappers of `forward`,
    or None where `forward` is not such a region."""
    fn = getattr(forward, "__marked_compile_region_fn__", None)
    while hasattr(fn, "__marked_compile_region_fn__"):
        fn = fn.__marked_compile_region_fn__
    return fn
