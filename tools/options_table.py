"""Print the options table of `fsdp_graph.backend(...)` (markdown), made from `BackendConfig`'s
fields and their docstrings: what docs/compiler.md holds between its options-table markers
(tests/test_pass_table.py checks it).

    python tools/options_table.py
"""

from fsdp_graph.compile.backend import BackendConfig
from fsdp_graph.compile.option_docs import options_table

if __name__ == "__main__":
    print(options_table(BackendConfig), end="")
