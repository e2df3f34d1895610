"""What every process pays at its first Inductor compile, paid once in the fork server the ranks
start from (`_harness.rank_context`), so that no rank pays it again: Inductor's modules, the probe
of the CPU's vector instruction sets (it builds and loads a small C++ program per candidate) and the
hash of torch's sources that Inductor's cache keys hold. Each result is kept in the process (an
import, a cached function), so a forked rank finds it; none of it is a Dynamo or a graph cache.
Also the modules the test files import that take long to import: a rank imports its test's module
to find the function it runs."""

import importlib

import pytest  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401
from torch._inductor import codecache, cpu_vec_isa

cpu_vec_isa.pick_vec_isa()
codecache.torch_key()

for optional in ("transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2"):
    try:  # the `hf` extra; tests that need it skip without it
        importlib.import_module(optional)
    except ImportError:
        pass
