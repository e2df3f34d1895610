"""The compile plumbing: the `fsdp_graph` backend for `torch.compile` (backend.py), `precompile`
(a compiled step saved by one launch and loaded by the next), the compile caches' keys
(cache_key.py), the partitioner repair (partition.py) and `predict` (a step's graphs captured on a
fake process group at any world size)."""
