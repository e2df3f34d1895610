"""torch 2.13 + torchtitan 0.3.0: its MoE debug model trains otherwise compiled than eager when its
selective activation checkpointing is on.

Torch alone (no fsdp_graph; one process, no FSDP, no expert parallelism; the CPU stand-ins of
examples/torchtitan_on_cpu.py). torchtitan's Trainer on `qwen3_moe_debug` (2 layers, 3 steps of
2 x 32 tokens), once eager and once with the model compiled by `torch.compile(backend="aot_eager")`,
`capture_scalar_outputs` on (the token dispatcher's `.tolist()` of routing counts), each in a fresh
process; prints both runs' losses and a digest of the routers' `expert_bias_E`:

    python examples/repro/torchtitan_moe_compile_with_ac.py            # checkpointing on: they differ
    python examples/repro/torchtitan_moe_compile_with_ac.py --no-ac    # checkpointing off: the same

On this machine, checkpointing on: the first losses are equal, the second and third differ (by 2e-4),
and so do the routers' load-balancing biases at the end; checkpointing off: every loss and
bias the same, bit for bit. So the compiled runs of tests/frameworks/torchtitan_moe_train.py (ours and
torch's `fully_shard` alike) turn torchtitan's checkpointing off; with it on, torch's `fully_shard`
compiled this way fails in torch itself ("expected all tensors_saved_with_vc_check to be Tensors":
a DeviceMesh saved for backward).
"""

import hashlib
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(mode: str, ac: bool, assets: str) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(HERE))
    import torchtitan_on_cpu

    torchtitan_on_cpu.prepare()
    config = torchtitan_on_cpu.moe_debug_config("qwen3_moe_debug", assets, layers=2, seq_len=32, batch=2, steps=3,
                                                expert_parallel_degree=1, data_parallel_shard_degree=1)
    if not ac:
        config.activation_checkpoint = None
    trainer = config.build()
    if mode == "compiled":
        torch._dynamo.config.capture_scalar_outputs = True
        trainer.model_parts[0].compile(backend="aot_eager")
    losses = torchtitan_on_cpu.record_losses(trainer)
    trainer.train()
    biases = {n: hashlib.sha256(b.detach().numpy().tobytes()).hexdigest()[:12]
              for n, b in trainer.model_parts[0].named_buffers() if "expert_bias" in n}
    print("RESULT " + json.dumps({"losses": losses, "expert_bias": biases}), flush=True)
    torch.distributed.destroy_process_group()


def main() -> None:
    ac = "--no-ac" not in sys.argv
    assets = tempfile.mkdtemp(prefix="titan-repro-")
    results = {}
    for mode in ("eager", "compiled"):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                   os.path.abspath(__file__), "--worker", mode, assets] + ([] if ac else ["--no-ac"])
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{mode} run failed:\n{(done.stdout + done.stderr)[-4000:]}")
        results[mode] = json.loads(line.removeprefix("RESULT "))
        print(f"{mode:9s} losses {results[mode]['losses']}  expert_bias {results[mode]['expert_bias']}")
    same = results["eager"] == results["compiled"]
    print(f"activation checkpointing {'on' if ac else 'off'}: compiled {'trains as' if same else 'trains otherwise than'} eager")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        index = sys.argv.index("--worker")
        run(sys.argv[index + 1], "--no-ac" not in sys.argv, sys.argv[index + 2])
    else:
        main()
