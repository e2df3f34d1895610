"""torch alone (no fsdp_graph): `torch.compile(...).aot_compile` of a transformers LlamaForCausalLM (transformers
5.24, torch 2.13) cannot be saved: Dynamo guards the identity of a code object inside transformers' own
decorator of `LlamaModel.forward` (transformers/utils/generic.py), an ID_MATCH guard, which torch's guard
serialization refuses ("PackageError: ID_MATCH guard cannot be serialized."). This is why
`fsdp_graph.precompile` falls back to plain `torch.compile` for such a model (docs/compiler.md).

    python examples/repro/hf_llama_aot_compile_guard.py

Prints the unserializable guards Dynamo built and whether the compiled function could be saved. Needs
`transformers` (the hf extra).
"""

import io

import torch
from torch._dynamo.guards import CheckFunctionManager
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    unserializable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    original = CheckFunctionManager.serialize_guards

    def report(self, builder, sorted_guards, output_graph):
        for guard in sorted_guards:
            kinds = {guard.create_fn_name(), *(guard.guard_types or ())}
            if kinds & set(unserializable):
                print(f"guard {sorted(kinds & set(unserializable))} on {guard.name}")
        return original(self, builder, sorted_guards, output_graph)

    CheckFunctionManager.serialize_guards = report
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=33,
                                         use_cache=False))
    tokens = torch.randint(0, 256, (2, 32))
    call = lambda module, x: module(x).logits
    try:
        compiled = torch.compile(call, backend="inductor", fullgraph=True).aot_compile(((model, tokens), {}))
        compiled.save_compiled_function(io.BytesIO())
        print("saved")
    except Exception as error:
        print(f"not saved: {type(error).__name__}: {str(error).splitlines()[0]}")


if __name__ == "__main__":
    main()
