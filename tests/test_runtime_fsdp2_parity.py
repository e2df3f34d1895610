"""Eager runtime against PyTorch's own FSDP2 on the same model and data: losses, gradients, counts."""

import copy

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from _harness import run_ranks
from _models import batch_for_step, comm_counts, global_mean, loss_fn, shard_llama, tiny_llama
from fsdp_graph import MixedPrecisionPolicy, fully_shard


def _against_fsdp2(rank, world_size, reshard_after_forward, mp=None):
    torch.manual_seed(0)
    model = tiny_llama(num_layers=3)
    kwargs = {"reshard_after_forward": reshard_after_forward}
    ours = shard_llama(copy.deepcopy(model), fully_shard, **kwargs,
                       **({"mp_policy": MixedPrecisionPolicy(**mp)} if mp else {}))
    theirs = shard_llama(copy.deepcopy(model), torch_fully_shard, **kwargs,
                         **({"mp_policy": TorchMixedPrecisionPolicy(**mp)} if mp else {}))
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    counts = []
    for step in range(5):
        _, _, x, y = batch_for_step(model, step, 8, rank, world_size)
        step_counts, losses = [], []
        for net in (ours, theirs):
            with CommDebugMode() as mode:
                loss = loss_fn(net, net(x), y)
                loss.backward()
            step_counts.append(comm_counts(mode))
            losses.append(global_mean(loss))
        counts.append(step_counts)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
        theirs_params = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            q = theirs_params[name]
            assert p.placements == q.placements, name
            torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"step {step} {name}: {m}")
        for opt in (opt_ours, opt_theirs):
            opt.step()
            opt.zero_grad()
    for name, p in ours.named_parameters():
        assert p.dtype == torch.float32, name  # shards stay fp32 (gradients: compared above)
        torch.testing.assert_close(p.to_local(), theirs_params[name].to_local(), rtol=1e-5, atol=1e-6)
    return counts


@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
def test_same_training_as_torch_fully_shard(reshard_after_forward):
    counts = run_ranks(_against_fsdp2, 2, reshard_after_forward)
    num_blocks, num_groups = 3, 4
    # Forward gathers every group; backward gathers again what was resharded after forward.
    regathered = {None: num_blocks, True: num_groups, False: 0}[reshard_after_forward]
    expected = {"_allgather_base_": num_groups + regathered, "_reduce_scatter_base_": num_groups}
    for ours, theirs in counts:
        assert ours == expected
        assert ours == theirs


def test_bf16_mixed_precision_same_as_torch_fully_shard():
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    counts = run_ranks(_against_fsdp2, 2, None, mp)
    for ours, theirs in counts:
        assert ours == theirs
