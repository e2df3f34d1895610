"""torch alone (no fsdp_graph): after `torch.compile` with a backend that is a plain callable, torch 2.13's
Dynamo keeps weak references to the parameters it traced, and `torch.utils.swap_tensors` on them then
raises "Cannot swap t1 because it has weakref associated with it". A registered backend ("eager",
"inductor") or `torch._dynamo.config.invalidate_compile_context_weakrefs = True` swaps fine. This is
why fsdp_graph's configured backend names itself as the registered "fsdp_graph" backend
([Note: Parameters swapped after a compile] in fsdp_graph/compile/backend.py).
`torch.compile(...).aot_compile(...)` (which `fsdp_graph.precompile` uses) keeps them whatever the
backend and the config, so parameters traced by it cannot be swapped afterwards: a limit of torch 2.13.

    python examples/repro/swap_after_custom_backend.py                  # a callable backend: refused
    python examples/repro/swap_after_custom_backend.py --backend eager  # a registered backend: swapped
    python examples/repro/swap_after_custom_backend.py --invalidate     # a callable, weakrefs dropped: swapped
    python examples/repro/swap_after_custom_backend.py --backend eager --invalidate --aot-compile   # refused
"""

import argparse

import torch
import torch.nn as nn


def plain_callable_backend(gm: torch.fx.GraphModule, example_inputs: list):
    return gm.forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default=None, help="a registered backend's name (default: a plain callable)")
    parser.add_argument("--invalidate", action="store_true", help="invalidate_compile_context_weakrefs=True")
    parser.add_argument("--aot-compile", action="store_true", help="compile ahead of time (fullgraph, aot_compile)")
    args = parser.parse_args()
    model = nn.Linear(4, 4)
    backend = args.backend or plain_callable_backend
    with torch._dynamo.config.patch(invalidate_compile_context_weakrefs=True if args.invalidate else None):
        if args.aot_compile:
            call = lambda module, x: module(x)
            torch.compile(call, backend=backend, fullgraph=True).aot_compile(((model, torch.randn(2, 4)), {}))
        else:
            torch.compile(model, backend=backend)(torch.randn(2, 4)).sum().backward()
    try:
        torch.utils.swap_tensors(model.weight, nn.Parameter(torch.zeros(4, 4)))
        print(f"backend {args.backend or 'callable'}{' (aot_compile)' * args.aot_compile}: swapped")
    except RuntimeError as error:
        print(f"backend {args.backend or 'callable'}{' (aot_compile)' * args.aot_compile}: RuntimeError: {error}")


if __name__ == "__main__":
    main()
