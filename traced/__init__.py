"""The traced call: how a sharded module behaves while Dynamo traces it.

Between the eager runtime (`runtime/`, which knows nothing of compiling) and the public face
(`fsdp_graph/`). `fully_shard` builds its states and groups from the classes here, which extend the
runtime's; `FSDPModule.__call__` hands every call Dynamo traces to `call.traced_call`. What decides
how a sharded block compiles lives here and nowhere else:

    call.py        the traced call's dispatch: into the step's graph, as a compile region, or out
                   onto the eager hooks (block scope, a region of the user's, settings a graph
                   cannot express)
    kinds.py       which blocks are of one kind, so that a trace reuses one region body for all
    state.py       TracedState / TracedGroup / TracedRootContext: the runtime's state with its
                   traced hooks, fallback decisions, region eligibility, gradient-flags leaf
    regions.py     the region function every block runs through, its flat arguments
    hooks.py       the forward hooks while Dynamo traces, and the fallback to the eager hooks
    callbacks.py   Dynamo's compile callbacks; what fsdp_graph keeps beyond a model
    unshard.py     the traced unshard: a group's gather and its gradient's reduce as graph nodes
    ops.py         the autograd functions and the op the traced unshard is made of
    scope.py       the compile scope and regions setting of the backend Dynamo traces for

Each file imports only those listed below it (the traced-layers contract in pyproject.toml).
"""
