"""AOTAutograd asks every call of a compile region for its schema; here each region body answers once.

[Note: A region's schema once per body]
Under autograd, torch 2.13 asks a higher-order op for its schema at every call, to refuse training
with a mutated input, and `invoke_subgraph` builds that schema by tracing the region's body again
(`InvokeSubgraphHOP.gen_schema`). AOTAutograd runs the step's forward more than once (its metadata
pass, its subclass pass, the joint trace), so a step whose blocks are regions traces every block's
body again two or three times, although Dynamo traced the body once and AOTAutograd's joint trace
reuses it (docs/benchmarks.md, "Regions that Dynamo traces once", has what it costs). Torch alone:
`python examples/repro/region_schema_per_call.py`.

The schema depends on the body and the kinds of the operands (tensor or number, and a tensor's
dtype, device, rank and whether it needs a gradient), not on which block calls it; so while our
backend compiles a graph that holds regions, the op's `gen_schema` answers from a table keyed by
those, computing each entry with torch's own method. The table holds the bodies it keys, so that no
key's `id` is reused within the compile, and is dropped after it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP, invoke_subgraph


def _operand_kind(operand: Any) -> tuple:
    if isinstance(operand, torch.Tensor):
        return (type(operand), operand.dtype, operand.device, operand.dim(), operand.requires_grad)
    return (type(operand),)


@contextlib.contextmanager
def region_schemas_once() -> Iterator[None]:
    """While it is open, `invoke_subgraph`'s schema is computed once per region body and operand
    kinds: [Note: A region's schema once per body]."""
    schemas: dict[tuple, tuple[torch.fx.GraphModule, Any]] = {}
    before = invoke_subgraph.__dict__.get("gen_schema")

    def gen_schema(subgraph, identifier, *operands):
        body = getattr(subgraph, "subgraph", subgraph)  # a functionalization wrapper holds the body
        if not isinstance(body, torch.fx.GraphModule):
            return InvokeSubgraphHOP.gen_schema(invoke_subgraph, subgraph, identifier, *operands)
        key = (id(body), identifier, tuple(_operand_kind(o) for o in operands))
        if key not in schemas:
            schemas[key] = (body, InvokeSubgraphHOP.gen_schema(invoke_subgraph, subgraph, identifier, *operands))
        return schemas[key][1]

    invoke_subgraph.gen_schema = gen_schema
    try:
        yield
    finally:
        if before is None:
            del invoke_subgraph.gen_schema
        else:
            invoke_subgraph.gen_schema = before
