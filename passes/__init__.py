"""Graph passes over the graphs the `fsdp_graph` backend compiles: table.py lists them in order
with their options, pipeline.py runs them, nodes.py holds the predicates and meta keys they share."""
