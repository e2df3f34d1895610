"""torch alone (no fsdp_graph): `torch.compiler.nested_compile_region` on the decoder layers of Hugging Face's
LlamaForCausalLM, compiled whole with Inductor on CPU, gives wrong gradients with torch 2.13; aot_eager and
Inductor without the region are exact. This is why fsdp_graph compiles graphs that hold such regions
without Inductor's buffer reuse (docs/compiler.md, Compile cost): with `torch._inductor.config.allow_buffer_reuse = False`
the region's gradients are exact (checked 2026-11-25: worst error 1.48e+04 with reuse, 6.43e-07 without).

    python examples/repro/nested_region_inductor_grads.py                 # region + inductor: wrong
    python examples/repro/nested_region_inductor_grads.py --no-region     # inductor alone: exact
    python examples/repro/nested_region_inductor_grads.py --backend aot_eager
    python examples/repro/nested_region_inductor_grads.py --no-buffer-reuse   # region + inductor, no reuse: exact

Prints the first step's worst relative gradient error against the same model run eagerly, per parameter
where it is over 1e-4. Needs `transformers` (the hf extra).
"""

import argparse
import copy

import torch
import torch._inductor.config
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (the error needs the region called twice)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--no-region", action="store_true", help="compile without nested_compile_region")
    parser.add_argument("--no-buffer-reuse", action="store_true", help="Inductor without buffer reuse (allow_buffer_reuse=False)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.no_buffer_reuse:
        torch._inductor.config.allow_buffer_reuse = False
    if not args.no_region:
        layer = modeling_llama.LlamaDecoderLayer
        layer.forward = torch.compiler.nested_compile_region(layer.forward)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=341, num_hidden_layers=args.layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, cfg.vocab_size, (4, 64))
    reference(input_ids=tokens, labels=tokens).loss.backward()
    torch.compile(model, backend=args.backend)(input_ids=tokens, labels=tokens).loss.backward()
    errors = {
        name: ((p.grad - q.grad).norm() / q.grad.norm()).item()
        for (name, p), q in zip(model.named_parameters(), reference.parameters())
    }
    for name, error in errors.items():
        if error > 1e-4:
            print(f"  {name}: {error:.2e}")
    region = "no region" if args.no_region else "decoder layers as nested_compile_region"
    region += ", no buffer reuse" if args.no_buffer_reuse else ""
    print(f"torch {torch.__version__}, {args.backend}, {region}: worst gradient error {max(errors.values()):.2e}")


if __name__ == "__main__":
    main()
