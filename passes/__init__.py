"""Graph passes over the graphs the `fsdp_graph` backend compiles. See pipeline.py for the runner."""
