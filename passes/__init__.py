"""Graph passes over the graphs the `fsdp_graph` backend compiles: table.py lists them in order
with their options, pipeline.py runs them, nodes.py holds the predicates and meta keys they share;
wire_order.py keeps a recompiled graph's collectives in the order of its frame's first graph."""
