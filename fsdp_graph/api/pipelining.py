"""Pipeline stages whose modules `fsdp_graph.fully_shard` sharded, for torch's pipeline schedules.

    from fsdp_graph.api.pipelining import PipelineStage    # instead of torch.distributed.pipelining's
    stage = PipelineStage(stage_module, stage_index, num_stages, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)   # any torch schedule

[Note: Pipeline schedules and FSDP]
A schedule runs several micro-batches' forwards and backwards per step, then asks each stage to
reduce (`perform_reduce_grad`). torch's stage recognises torch's own `FSDPModule` only; a module
sharded by fsdp_graph would reduce-scatter after every micro-batch's backward. This stage gives
fsdp_graph's modules the same treatment torch's get:
- each micro-batch's backward runs with gradient sync off, `reshard_after_backward=False` and
  `is_last_backward=False`: gradients accumulate unsharded and unreduced, and the parameters stay
  gathered for the next micro-batch (with `reshard_after_forward=False` a group is gathered once
  per step);
- `perform_reduce_grad` turns the three back on and finishes the backward: one reduce-scatter per
  group per step, then reshard;
- the schedule's metadata inference (a real forward and backward before the first step) leaves no
  gathered parameters or gradients behind.
Compiled stage modules run these accumulating backwards on the eager hooks (see docs/compiler.md:
no_sync under compile), like any backward with gradient sync off.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed import pipelining

from .module import FSDPModule


class PipelineStage(pipelining.PipelineStage):
    """`torch.distributed.pipelining.PipelineStage` for a module sharded with `fsdp_graph.fully_shard`.

    Takes the same arguments; the stage module (or modules inside it) must be `fully_shard`ed.
    """

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        for root in _fsdp_roots(self.submod):
            _set_accumulating(root, True)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int):
        for root in _fsdp_roots(self.submod):
            _set_accumulating(root, False)
            root._fsdp_state.finish_backward()
        super().perform_reduce_grad(grad_scale_factor)  # scales the reduced gradients

    def _prepare_backward_infra(self, *args, **kwargs):
        # Metadata inference computes input gradients only: nothing to reduce.
        for root in _fsdp_roots(self.submod):
            _set_accumulating(root, True)
        return super()._prepare_backward_infra(*args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        for root in _fsdp_roots(self.submod):
            _set_accumulating(root, False)
            root._fsdp_state.discard_gradients()


def _fsdp_roots(module: nn.Module) -> list[FSDPModule]:
    """The outermost fsdp_graph modules in `module` (the module itself when it was sharded last)."""
    roots = [m for m in module.modules() if isinstance(m, FSDPModule) and m._fsdp_state.is_root]
    if not roots:
        raise ValueError(
            f"fsdp_graph.api.pipelining.PipelineStage got a {type(module).__name__} with no module sharded by "
            f"fsdp_graph.fully_shard; shard the stage module first, or use "
            f"torch.distributed.pipelining.PipelineStage"
        )
    return roots


def _set_accumulating(root: FSDPModule, accumulating: bool) -> None:
    root.set_requires_gradient_sync(not accumulating)
    root.set_reshard_after_backward(not accumulating)
    root.set_is_last_backward(not accumulating)
