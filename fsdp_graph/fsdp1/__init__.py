"""FSDP1's conveniences, above `fully_shard`: auto-wrapping policies and sharding strategies
(wrap.py), full parameters and state dicts (full_params.py), communication hooks (comm_hooks.py).
See docs/migrating.md."""
