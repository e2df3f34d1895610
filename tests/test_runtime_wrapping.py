"""Ways of wrapping: root only, nested, several modules in one group, tied and frozen parameters."""

import torch
from torch.distributed.tensor import DTensor

from _harness import run_ranks
from _models import MLPStack, shard_blocks_then_root, shard_llama, tiny_llama, train_and_compare
from fsdp_graph import FSDPModule, fully_shard


def _root_only(rank, world_size):
    torch.manual_seed(0)
    train_and_compare(MLPStack(), fully_shard, rank, world_size)


def test_root_only():
    run_ranks(_root_only, 2)


def _class_swap(rank, world_size):
    model = MLPStack()
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict().keys())
    shard_blocks_then_root(model)
    assert type(model).__name__ == "FSDPMLPStack"
    assert isinstance(model, MLPStack) and isinstance(model, FSDPModule)
    assert isinstance(model.blocks[0], FSDPModule) and not isinstance(model.inp, FSDPModule)
    assert [n for n, _ in model.named_parameters()] == names
    state = model.state_dict()
    assert list(state.keys()) == keys
    assert all(isinstance(v, DTensor) for v in state.values())


def test_class_names_and_state_dict_keys_unchanged():
    run_ranks(_class_swap, 2)


def _tied_list(rank, world_size):
    torch.manual_seed(0)
    model = tiny_llama()
    model.output.weight = model.tok_embeddings.weight

    def shard(m):
        for layer in m.layers:
            fully_shard(layer)
        fully_shard([m.tok_embeddings, m.output])
        fully_shard(m)
        assert m.output.weight is m.tok_embeddings.weight
        return m

    train_and_compare(model, shard, rank, world_size)


def test_tied_embedding_and_head_in_one_list_group():
    run_ranks(_tied_list, 2)


def _tied_root(rank, world_size):
    torch.manual_seed(0)
    model = tiny_llama()
    model.output.weight = model.tok_embeddings.weight
    train_and_compare(model, lambda m: shard_llama(m, fully_shard), rank, world_size)


def test_tied_parameters_in_the_root_group():
    run_ranks(_tied_root, 2)


def _frozen(rank, world_size):
    torch.manual_seed(0)
    model = MLPStack()
    for block in model.blocks:
        block.up.weight.requires_grad_(False)  # frozen and trainable in one group
    model.inp.requires_grad_(False)

    def shard(m):
        shard_blocks_then_root(m)
        return m

    train_and_compare(model, shard, rank, world_size)


def test_frozen_parameters_inside_a_group():
    run_ranks(_frozen, 2)


def _ignored(rank, world_size):
    torch.manual_seed(0)
    model = MLPStack()
    sharded = MLPStack()
    sharded.load_state_dict(model.state_dict())
    fully_shard(sharded, ignored_params={sharded.head.weight})
    assert not isinstance(sharded.head.weight, DTensor)
    assert isinstance(sharded.head.bias, DTensor)
    x = torch.randn(4, 13)
    sharded(x).sum().backward()
    # Ignored parameters are neither sharded nor reduced: their gradient is this rank's own.
    model(x).sum().backward()
    torch.testing.assert_close(sharded.head.weight.grad, model.head.weight.grad)


def test_ignored_params_stay_local():
    run_ranks(_ignored, 2)
