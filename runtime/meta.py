"""The `node.meta` keys the traced hooks write, for the passes to read.

The traced unshard (traced/unshard.py) runs under `torch.fx.traceback.annotate`, so every node it
makes, and every backward node AOTAutograd derives from them, carries `node.meta["custom"]` with the
keys below. They live here, with their writer, so the runtime never imports the compiler; passes
read them through passes/nodes.py.
"""

GROUP_KEY = "fsdp_graph_group"  # the group's module FQN(s), e.g. "layers.0"
RESHARD_KEY = "fsdp_graph_reshard_after_forward"  # bool: backward must gather again
ROLE_KEY = "fsdp_graph_role"  # one of the ROLE_* values

ROLE_UNSHARD = "unshard"  # copy-in, all-gather, wait, copy-out (and their backward: the reduce-scatter)
