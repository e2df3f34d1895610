"""The simulator's memory model against what gloo really holds while a collective runs (2 gloo ranks).

A memory budget is judged on the simulator's prediction, so the prediction must not fall short of
the heap: gloo's all-gather holds a copy of its output while it runs, its reduce-scatter a copy of
its input until the wait (examples/repro/gloo_collective_scratch.py shows it with torch alone).
"""

import multiprocessing

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import fsdp_graph
from fsdp_graph import fully_shard
from _harness import run_ranks
import _models  # noqa: F401  puts examples/ on the path
from repro.gloo_collective_scratch import measure, one_malloc_arena  # torch alone: the heap while a collective runs

if multiprocessing.parent_process() is not None:
    # A rank imports this module to find its function, before its process group starts gloo's
    # threads: one malloc arena, or the heap's readings can count a buffer twice.
    one_malloc_arena()

_NUMEL = 1 << 20  # 4 MiB of fp32
_MIB = 2**20


def _predicted_while_in_flight(fn, *inputs) -> int:
    """The simulator's live bytes at the collective of `fn`'s graph (traced as a compiled step is)."""
    from fsdp_graph.passes.gloo import plain_all_gathers_on_gloo
    from fsdp_graph.passes.simulator import OpKind, memory_profile, program_of

    gm = plain_all_gathers_on_gloo(make_fx(fn)(*inputs))
    program = program_of(gm)
    at = next(i for i, op in enumerate(program) if op.kind is OpKind.COLLECTIVE)
    return memory_profile(program).live_bytes[at]


def _gloo_collectives(rank, world_size):
    group = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    x = torch.ones(_NUMEL)
    shard = torch.ones(_NUMEL // world_size)

    def reduce_scatter(t):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(t, "sum", world_size, group))

    def all_gather(t):  # the passes turn it into all_gather_into_tensor_out on gloo
        return c10d.wait_tensor(c10d.all_gather_into_tensor(t, world_size, group))

    results = {}
    for name, fn, issue, arg in (
        ("reduce_scatter", reduce_scatter, lambda: c10d.reduce_scatter_tensor(x, "sum", world_size, group), x),
        ("all_gather", all_gather, lambda: c10d.all_gather_into_tensor_out(shard, world_size, group, out=torch.empty(_NUMEL)), shard),
    ):
        predicted = _predicted_while_in_flight(fn, arg) / _MIB
        measured = [measure(issue) for _ in range(3)][1:]  # the first call warms gloo up
        results[name] = (predicted, max(m[1] for m in measured), max(m[2] for m in measured))
    return results


def test_predicted_memory_covers_what_gloo_holds():
    results = run_ranks(_gloo_collectives, 2)
    for name, (predicted, peak, before_wait) in results.items():
        # MiB. Sampling can miss a short peak but, with one malloc arena, never invents one; 256 KiB
        # of slack (3%) for gloo's and the sampling thread's own small allocations.
        assert peak <= predicted + 0.25, (name, predicted, peak)
        assert before_wait <= predicted, (name, predicted, before_wait)
        # And the copies are there to be covered: more than the output alone.
        assert peak > 1.5 * (_NUMEL * 4 / _MIB / (2 if name == "reduce_scatter" else 1)), (name, peak)


def test_a_saved_view_counts_its_whole_storage():
    """Reference: the storages the compiled forward really saves (autograd's saved-tensor hooks).
    As in GPT-NeoX's attention, k and v are views of one fused projection and reach attention as
    they are: saving them keeps the whole projection alive, once."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from fsdp_graph.passes.simulator import OpKind, memory_profile, program_of

    torch.manual_seed(0)
    qkv = torch.nn.Linear(64, 3 * 64)
    x = torch.randn(32, 64)  # 2 x 16 tokens, flat: the projection's gradient reads x itself, not a view of it
    graphs = {}

    def keep(kind):
        def compiler(gm, _inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def attention(x):
        q, k, v = qkv(x).view(2, 16, 4, 48).transpose(1, 2).chunk(3, dim=-1)
        return torch.nn.functional.scaled_dot_product_attention(q * 2, k, v)

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           partition_fn=min_cut_rematerialization_partition)  # Inductor's partitioner
    torch._dynamo.reset()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = torch.compile(attention, backend=backend)(x)
    out.sum().backward()
    torch._dynamo.reset()
    resident = {t.untyped_storage().data_ptr() for t in (x, qkv.weight, qkv.bias)}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    projection = 2 * 16 * 3 * 64 * 4
    assert projection in storages.values()  # k's and v's: the whole projection is kept
    made = sum(n for ptr, n in storages.items() if ptr not in resident)
    # The backward's live bytes once its inputs are in: what the step made and saved for it.
    program = program_of(graphs["backward"])
    inputs_in = max(i for i, op in enumerate(program) if op.kind is OpKind.INPUT)
    assert memory_profile(program).live_bytes[inputs_in] == made


def _compiled_step_heap(rank, world_size, dump_dir):
    """HF GPT-NeoX, 2 blocks, compiled with Inductor on gloo: (the simulator's peak of the step's
    graphs above its start, the heap measured above the step's start). Its attention saves query,
    key and value as views of one fused projection; its flat gradient and gathered buffers are the
    same size, which Inductor's buffer reuse would pair."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from fsdp_graph.inspect.timeline import load_programs
    from fsdp_graph.passes.simulator import memory_profile
    from repro.gloo_collective_scratch import heap_peak

    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=256, hidden_size=256, intermediate_size=682, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=65, use_cache=False))
    for layer in model.gpt_neox.layers:
        fully_shard(layer)
    fully_shard(model)
    compiled = torch.compile(model, backend=fsdp_graph.backend(compiler="inductor", dump_dir=f"{dump_dir}/{rank}"))
    tokens = torch.randint(0, 256, (4, 64))

    def step():
        compiled(tokens).logits.sum().backward()
        model.zero_grad(set_to_none=True)

    step()
    step()
    dist.barrier()
    with heap_peak() as peak:
        compiled(tokens).logits.sum().backward()
    predicted = max(memory_profile(program).peak_bytes for program in load_programs(f"{dump_dir}/{rank}").values())
    return predicted / _MIB, peak[0] / _MIB


@pytest.mark.slow  # Inductor compiles cold
def test_compiled_step_holds_no_more_than_predicted(tmp_path):
    # The whole step on real gloo ranks, a model with fused projections, against the plan's peak.
    # Under Inductor the plan keeps gloo's reduce-scatter copies that the in-place all-reduce has
    # not ([Note: Reduce-scatters on gloo]): a bucket of margin, which hides Inductor's buffer
    # reuse here (16.5 MiB measured with it, 14.1 without, 17.6 planned); the saved views have the
    # test above.
    torch._dynamo.reset()
    predicted, measured = run_ranks(_compiled_step_heap, 2, str(tmp_path))
    # MiB. Outside the graphs the step also holds the logits, their gradient and the sum's: 0.5 MiB.
    assert measured <= predicted + 0.75, (predicted, measured)


def test_a_regions_outputs_die_one_by_one():
    """A compile region hands back tensors of their own: each dies after its own last reader, and
    the region's inputs outlive its outputs' allocation. The step's predicted peak with its two
    region calls equals that of the same step with the regions inlined: three 4 MiB tensors at
    most, as the first call's first output dies before the step makes two more."""
    import copy

    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.passes.inline_invoke_subgraph import inline_invoke_subgraph
    from fsdp_graph.passes.simulator import memory_profile, program_of

    @torch.compiler.nested_compile_region
    def body(x):
        return x * 2, x * 3

    def step(x):
        a, b = body(x)
        s = a.sum()  # the first output's last reader
        t = x * 5
        u = b * t
        c, d = body(u)  # a second call: Dynamo keeps the region
        return s + c.sum(), d

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(step, backend=aot_autograd(fw_compiler=keep))(torch.ones(_NUMEL))
    (gm,) = graphs
    assert sum(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes) == 2
    inlined = inline_invoke_subgraph(copy.deepcopy(gm))
    inlined.recompile()
    with_regions, without = (memory_profile(program_of(g)).peak_bytes for g in (gm, inlined))
    assert with_regions == without and 12 * _MIB <= without < 12 * _MIB + 64, (with_regions, without)
