"""The compile plumbing: the `fsdp_graph` backend for `torch.compile` (backend.py), `precompile`
(a compiled step saved by one launch and loaded by the next), the compile caches' keys
(cache_key.py) and the partitioner repair (partition.py). The pass table they compile with is
passes/table.py; `fsdp_graph.predict` (fsdp_graph/predict.py) captures and schedules a step's graphs
on a fake process group at any world size."""
