"""Runs a script taken from a page of docs/frameworks/ as torchrun's entry point, then reports what
tests/test_docs_frameworks.py checks of the model it leaves behind: which `fully_shard` sharded it,
and its full parameters after training.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/frameworks/run_doc_script.py \
        OUT_DIR SCRIPT [ARGS...]

The script runs unchanged as `__main__` with `sys.argv` = [SCRIPT, *ARGS]. The trained model is the
script's `trainer.model` if it has a `trainer` (TRL, Transformers), else its `model` (Lightning's
wrapper unwrapped). Rank 0 writes OUT_DIR/result.json and OUT_DIR/params.pt.
"""

import json
import os
import runpy
import sys

import torch
import torch.distributed as dist


def trained_model(names: dict) -> torch.nn.Module:
    trainer = names.get("trainer")
    model = trainer.model if hasattr(trainer, "model") else names["model"]
    return getattr(model, "_original_module", model)  # Lightning Fabric's wrapper


def sharded_by(model: torch.nn.Module) -> dict:
    # Imported here, after the script: torch's own module keeps torch's class, whatever the script
    # replaced ([Note: Where the names are replaced] in fsdp_graph/api/stand_in.py).
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule as TorchFSDPModule

    from fsdp_graph import FSDPModule

    return {
        "fsdp_graph": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "torch": sum(isinstance(m, TorchFSDPModule) for m in model.modules()),
    }


def full_parameters(model: torch.nn.Module) -> dict:
    """Every parameter whole, on the CPU; a collective, so every rank calls it."""
    full = {}
    for name, p in model.named_parameters():
        value = p.detach()
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        full[name] = value.cpu().clone()
    return full


def main() -> None:
    out_dir, script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    names = runpy.run_path(script, run_name="__main__")
    if not dist.is_initialized():
        raise RuntimeError(f"{script} left no process group: the page's script must not destroy it")
    model = trained_model(names)
    result = {"sharded_by": sharded_by(model), "world_size": dist.get_world_size()}
    params = full_parameters(model)
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        torch.save(params, os.path.join(out_dir, "params.pt"))
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    # [Note: Gloo teardown] in tests/_harness.py: torch 2.13's gloo teardown at interpreter exit
    # aborts now and then, after the page's script and every check's data are done; leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
