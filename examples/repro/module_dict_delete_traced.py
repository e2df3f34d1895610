"""Which ways of removing a key from a module's `__dict__` Dynamo traces without a graph break.

Torch alone (no fsdp_graph). The traced unshard (traced/unshard.py, [Note: Traced unshard]) shadows
a module's parameter with `module.__dict__[name] = tensor` and removes the shadow after forward.
Each way below runs inside `torch.compile(..., fullgraph=True, backend="eager")`:

    python examples/repro/module_dict_delete_traced.py

torch 2.13.0+cpu: every way but `object.__delattr__` traces. torch 2.11.0+cu130 (the device
machine's torch): none does ("Unsupported method call"), so the whole-step graph cannot be traced
there as it is (docs/benchmarks.md, One H100). Pointing the key at the registered parameter instead
(`module.__dict__[name] = module._parameters[name]`, the last way below) traces on both, which
tools/device/torch211.py uses (docs/benchmarks.md, One H200).
"""

import torch


class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _del(module: torch.nn.Module) -> None:
    del module.__dict__["weight"]


def _point_back(module: torch.nn.Module) -> None:
    module.__dict__["weight"] = module._parameters["weight"]


WAYS = {
    "del module.__dict__[name]": _del,
    "module.__dict__.__delitem__(name)": lambda m: m.__dict__.__delitem__("weight"),
    "module.__dict__.pop(name, None)": lambda m: m.__dict__.pop("weight", None),
    "vars(module).pop(name)": lambda m: vars(m).pop("weight"),
    "dict.__delitem__(module.__dict__, name)": lambda m: dict.__delitem__(m.__dict__, "weight"),
    "dict.pop(module.__dict__, name)": lambda m: dict.pop(m.__dict__, "weight"),
    "object.__delattr__(module, name)": lambda m: object.__delattr__(m, "weight"),
    "module.__dict__[name] = module._parameters[name] (no removal)": _point_back,
}


def main() -> None:
    print(torch.__version__)
    for name, remove in WAYS.items():
        torch._dynamo.reset()
        module = Scale()

        def step(x: torch.Tensor) -> torch.Tensor:
            module.__dict__["weight"] = torch.full((3,), 2.0)  # the shadow: 2x
            y = module(x)
            remove(module)  # the parameter again: 1x
            return y + module(x)

        try:
            out = torch.compile(step, fullgraph=True, backend="eager")(torch.ones(3))
            print(f"{name}: traced, {out.tolist()} (expected [3.0, 3.0, 3.0]), shadow left: {'weight' in module.__dict__}")
        except Exception as error:  # Dynamo's Unsupported, wrapped
            print(f"{name}: graph break: {type(error).__name__}: {str(error).splitlines()[0][:120]}")


if __name__ == "__main__":
    main()
