"""`fsdp_graph.run_in_chunks` in one process, against the module run whole: the numbers, the
arguments it slices and those it passes whole, the outputs it puts together, and its refusals."""

import pytest
import torch
import torch.nn as nn

from fsdp_graph import run_in_chunks


class _PerToken(nn.Module):
    """An MLP over the last dim, scaled by a per-token `gate` (sliced with x) and a `bias` of its
    own shape (passed whole); returns a tuple and a list, as MoE layers return extra outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.calls = 0

    def forward(self, x, gate, bias=None):
        self.calls += 1
        y = self.mlp(x) * gate + (0 if bias is None else bias)
        return y, [y.sum(-1, keepdim=True)]


def _run(module, dim, seed=0):
    torch.manual_seed(seed)
    shape = (6, 5, 8) if dim == 0 else (3, 10, 8)
    x = torch.randn(shape, requires_grad=True)
    gate = torch.rand(shape[:2] + (1,))
    y, (s,) = module(x, gate, bias=torch.randn(8))
    (y.pow(2).mean() + s.mean()).backward()
    return y, s, x.grad, [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("dim", [0, 1], ids=["batch", "sequence"])
def test_chunks_compute_what_the_whole_module_computes(dim):
    torch.manual_seed(0)
    whole = _PerToken()
    sliced = run_in_chunks(_PerToken(), chunks=3, dim=dim)
    sliced.load_state_dict(whole.state_dict())
    expected, got = _run(whole, dim), _run(sliced, dim)
    assert sliced.calls == 3 and whole.calls == 1
    for e, g in zip(expected[:3], got[:3]):  # outputs and the input's gradient: token by token
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
    for e, g in zip(expected[3], got[3]):  # weights' gradients: sums over tokens, in three parts
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_fewer_tokens_than_chunks_make_fewer_slices():
    module = run_in_chunks(_PerToken(), chunks=4)
    y, _ = module(torch.randn(2, 8), torch.ones(2, 1))
    assert module.calls == 2 and y.shape == (2, 8)


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="positive int"):
        run_in_chunks(_PerToken(), chunks=0)
    with pytest.raises(TypeError, match="nn.Module"):
        run_in_chunks(lambda x: x)
    module = run_in_chunks(_PerToken())
    with pytest.raises(ValueError, match="once per module"):
        run_in_chunks(module)

    class _Dict(nn.Module):
        def forward(self, x):
            return {"y": x}

    with pytest.raises(ValueError, match="no dim 2 to slice"):
        run_in_chunks(_PerToken(), dim=2)(torch.randn(4, 8), torch.ones(4, 1))
    with pytest.raises(TypeError, match="only tensors, or tuples and lists"):
        run_in_chunks(_Dict())(torch.randn(4, 2))


def test_a_copy_runs_its_own_weights():
    """`copy.deepcopy` of a sliced module (the test harnesses copy models) computes with the copy's
    parameters, in slices too."""
    import copy

    original = run_in_chunks(_PerToken(), chunks=2)
    clone = copy.deepcopy(original)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    y, _ = clone(torch.randn(4, 8), torch.ones(4, 1))
    assert clone.calls == 2 and original.calls == 0
    assert torch.equal(y, torch.zeros(4, 8))


def test_a_forward_set_on_the_instance_runs_in_slices():
    """torchtitan sets `module.forward` on the instance (its redistribution wrapper): that forward
    is the one run on each slice."""
    module = _PerToken()
    inner = module.forward
    seen = []

    def wrapped(x, gate, bias=None):
        seen.append(x.shape[0])
        return inner(x, gate, bias)

    module.forward = wrapped
    run_in_chunks(module, chunks=2)
    y, _ = module(torch.randn(6, 8), torch.ones(6, 1))
    assert seen == [3, 3] and module.calls == 2 and y.shape == (6, 8)
