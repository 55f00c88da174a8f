"""The linear layers' weight gradients added straight into the fp32 main_grad (parallel.linear, Megatron's
gradient_accumulation_fusion): against fp64 sums of the same half-precision products, against autograd's .grad
path (parallel.fuses_weight_gradient patched off), and the GradBuffer's bucket launches against that path's."""

import contextlib
import types

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import parallel
from helpers import random_batches
from model import GPT, GPTConfig

H, OUT, TOKENS = 64, 96, (2, 24)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def unfused(monkeypatch):
    """Autograd's path for every weight: its .grad, which the GradBuffer's hook adds into main_grad."""
    monkeypatch.setattr(parallel, "fuses_weight_gradient", lambda weight: False)


def _layer_backwards(dtype, k, scale):
    """A column-parallel layer in dtype with a GradBuffer, k backwards of random inputs and upstream gradients.
    Returns (layer, the inputs with their .grad, the upstream gradients)."""
    torch.manual_seed(0)
    layer = parallel.ColumnParallelLinear(H, OUT).to(dtype)
    buffer = parallel.GradBuffer(layer.parameters(), torch.float32)
    buffer.start(k)
    xs = [torch.randn(*TOKENS, H).to(dtype).requires_grad_() for _ in range(k)]
    gs = [(scale * torch.randn(*TOKENS, OUT)).to(dtype) for _ in range(k)]
    for x, g in zip(xs, gs):
        layer(x).backward(g)
    return layer, xs, gs


@pytest.mark.parametrize("dtype,scale", [(torch.bfloat16, 1.0), (torch.float16, 1024.0)])
def test_half_weight_gradient_is_the_fp32_sum_of_the_half_products(dtype, scale, monkeypatch):
    """After 3 micro-batches main_grad is sum_k g_k^T x_k of the half-precision operands summed in fp32: within
    1e-5 of sum |g_k|^T |x_k| of the fp64 sum, elementwise (48 products a micro-batch: fp32's accumulation error is
    ~3e-6 of it). The .grad path rounds each product to the half dtype first, which this bound tells apart (checked
    below). The input's and the bias's gradients are autograd's, bit for bit. fp16 with a loss scale of 1024."""
    layer, xs, gs = _layer_backwards(dtype, 3, scale)
    assert layer.weight.grad is None
    flat = [
        (g.reshape(-1, OUT).double(), x.detach().reshape(-1, H).double()) for g, x in zip(gs, xs)
    ]
    exact = sum(g.t() @ x for g, x in flat)
    bound = 1e-5 * sum(g.abs().t() @ x.abs() for g, x in flat)
    assert ((layer.weight.main_grad.double() - exact).abs() <= bound).all()
    unfused(monkeypatch)
    plain, plain_xs, _ = _layer_backwards(dtype, 3, scale)
    # the bound catches bf16 rounding
    assert ((plain.weight.main_grad.double() - exact).abs() > bound).any()
    assert torch.equal(layer.bias.main_grad, plain.bias.main_grad)
    assert all(torch.equal(x.grad, y.grad) for x, y in zip(xs, plain_xs))


def test_fp32_weight_keeps_autograds_path():
    """fp32 weights are not fused (an addmm into a non-zero sum is not bit for bit main_grad.add_(product)): their
    .grad is made and the hook adds it, as before."""
    layer = parallel.ColumnParallelLinear(H, OUT)
    buffer = parallel.GradBuffer(layer.parameters(), torch.float32)
    # the post-accumulate hook runs once autograd has accumulated a .grad (the buffer's frees it)
    made = []
    layer.weight.register_post_accumulate_grad_hook(lambda p: made.append(p))
    buffer.start(1)
    x = torch.randn(*TOKENS, H, requires_grad=True)
    layer(x).sum().backward()
    assert made == [layer.weight]
    torch.testing.assert_close(
        layer.weight.main_grad,
        torch.ones(*TOKENS, OUT).reshape(-1, OUT).t() @ x.detach().reshape(-1, H),
        rtol=0,
        atol=1e-5,
    )


CFG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=24,
    vocab_size=512,
    make_vocab_size_divisible_by=128,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
MICRO_BATCHES = 2


class HalfWeightProducts(TorchDispatchMode):
    """Counts the matmul outputs made in bf16 with the shape of one of `shapes` (a weight's gradient)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
            and out.dtype == torch.bfloat16
            and tuple(out.shape) in self.shapes
        ):
            self.count += 1
        return out


def _train_micro_batches(checkpoint_activations, bucket_numel=2**22, mode=None):
    """A bf16 GPT with a GradBuffer through MICRO_BATCHES backwards of one step; returns (model, the main_grads
    after each backward, the buffer)."""
    model = GPT(GPTConfig(**CFG, checkpoint_activations=checkpoint_activations))
    model.init_weights(1234)
    model = model.to(torch.bfloat16).train()
    buffer = parallel.GradBuffer(model.parameters(), torch.float32, bucket_numel=bucket_numel)
    buffer.start(MICRO_BATCHES)
    after = []
    for x, y in random_batches(0, MICRO_BATCHES, 2, CFG["seq_length"], CFG["vocab_size"]):
        loss = model(x, y)
        with mode if mode is not None else contextlib.nullcontext():
            loss.backward()
        after.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
    return model, after, buffer


def _linear_weights(model):
    return {n: p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2}


@pytest.mark.parametrize("checkpoint_activations", [False, True])
def test_model_backward_makes_no_bf16_weight_gradient_and_matches_the_grad_path(
    checkpoint_activations, monkeypatch
):
    """A 2-layer bf16 GPT, 2 micro-batches: the fused backward makes no bf16 matmul output of a linear weight's shape
    (the .grad path makes one per linear per micro-batch, 16 here), no .grad of those weights, and its main_grads
    differ from the .grad path's by the bf16 roundings of that path's products alone: elementwise within 2^-8 of the
    sum over micro-batches of |each micro-batch's product| (round to nearest: 2^-9 each), plus 1e-6 of the largest
    element for the fp32 sums' order; every other parameter's main_grad identical. With activation recomputation too.
    """
    model = GPT(GPTConfig(**CFG))
    shapes = {tuple(p.shape) for p in _linear_weights(model).values()}
    # no activation (48 tokens) of a weight's shape
    assert len(shapes) == 4 and 2 * 24 not in {s[0] for s in shapes}
    fused_mode = HalfWeightProducts(shapes)
    fused, fused_after, _ = _train_micro_batches(checkpoint_activations, mode=fused_mode)
    unfused(monkeypatch)
    plain_mode = HalfWeightProducts(shapes)
    _, plain_after, _ = _train_micro_batches(checkpoint_activations, mode=plain_mode)
    linears = _linear_weights(fused)
    assert fused_mode.count == 0 and plain_mode.count == len(linears) * MICRO_BATCHES == 16, (
        fused_mode.count,
        plain_mode.count,
    )
    assert all(p.grad is None for p in linears.values())
    for name, got in fused_after[-1].items():
        want = plain_after[-1][name]
        if name not in linears:
            assert torch.equal(got, want), name
            continue
        sums = [step[name] for step in plain_after]
        products = [sums[0]] + [b - a for a, b in zip(sums, sums[1:])]
        bound = 2.0**-8 * sum(p.abs() for p in products) + 1e-6 * want.abs().max()
        assert ((got - want).abs() <= bound).all(), name
        assert not torch.equal(got, want), name  # the products were not rounded to bf16 on the way


def test_data_parallel_buckets_launch_in_the_same_order_during_the_last_backward(monkeypatch):
    """A data-parallel GradBuffer of small buckets (its all-reduce recorded instead of run): the fused path launches
    the same buckets in the same order as the .grad path, each once, all during the last micro-batch's backward
    (overlapped with it, none left for finish())."""

    def launches():
        launched, phase = [], ["forward"]
        model = GPT(GPTConfig(**CFG))
        model.init_weights(1234)
        model = model.to(torch.bfloat16)
        buffer = parallel.GradBuffer(model.parameters(), torch.float32, bucket_numel=2**13)
        buffer.group, buffer.size = "dp", 1

        def all_reduce(flat, **kwargs):
            launched.append((phase[0], next(i for i, b in enumerate(buffer.buckets) if b is flat)))
            return types.SimpleNamespace(wait=lambda: None)

        monkeypatch.setattr(parallel.dist, "all_reduce", all_reduce)
        buffer.start(MICRO_BATCHES)
        for i, (x, y) in enumerate(
            random_batches(0, MICRO_BATCHES, 2, CFG["seq_length"], CFG["vocab_size"])
        ):
            phase[0] = f"backward {i}"
            model(x, y).backward()
        phase[0] = "finish"
        buffer.finish()
        return launched, len(buffer.buckets)

    fused, buckets = launches()
    unfused(monkeypatch)
    plain, _ = launches()
    assert buckets > 4 and fused == plain, (fused, plain)
    assert [b for _, b in fused] == list(range(buckets))
    assert {phase for phase, _ in fused} == {f"backward {MICRO_BATCHES - 1}"}


def test_no_grad_and_evaluation_take_the_plain_op():
    """Without a gradient wanted (evaluation, no_grad) linear() is F.linear itself, bit for bit."""
    layer = parallel.ColumnParallelLinear(H, OUT).to(torch.bfloat16)
    parallel.GradBuffer(layer.parameters(), torch.float32)
    x = torch.randn(*TOKENS, H, dtype=torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
    assert y.grad_fn is None and torch.equal(y, F.linear(x, layer.weight, layer.bias))


def _bucket_launches_and_grads(compiled, interleaved, monkeypatch):
    """A bf16 GPT with activation recomputation and a data-parallel GradBuffer (its all-reduce recorded instead of
    run) through two micro-batches: sequential, or 1F1B's order (both forwards, then both backwards). Returns (the
    buckets launched, in order, with the backward that launched them; the main_grads; graph breaks)."""
    torch._dynamo.reset()
    counters["graph_break"].clear()
    model = GPT(GPTConfig(**CFG, checkpoint_activations=True))
    model.init_weights(1234)
    model = model.to(torch.bfloat16).train()
    if compiled:
        model.compile_blocks(backend="aot_eager")
    buffer = parallel.GradBuffer(model.parameters(), torch.float32, bucket_numel=2**13)
    buffer.group, buffer.size = "dp", 1
    launched, phase = [], ["forward"]

    def all_reduce(flat, **kwargs):
        launched.append((phase[0], next(i for i, b in enumerate(buffer.buckets) if b is flat)))
        return types.SimpleNamespace(wait=lambda: None)

    monkeypatch.setattr(parallel.dist, "all_reduce", all_reduce)
    buffer.start(MICRO_BATCHES)
    batches = random_batches(0, MICRO_BATCHES, 2, CFG["seq_length"], CFG["vocab_size"])
    losses = [model(x, y) for x, y in batches] if interleaved else []
    for i, (x, y) in enumerate(batches):
        loss = losses[i] if interleaved else model(x, y)
        phase[0] = f"backward {i}"
        loss.backward()
    phase[0] = "finish"
    buffer.finish()
    return (
        launched,
        {n: p.main_grad for n, p in model.named_parameters()},
        sum(counters["graph_break"].values()),
    )


def test_compiled_blocks_fuse_the_same_and_1f1b_order_works(monkeypatch):
    """Compiled blocks (dynamo and AOT autograd, the aot_eager backend) trace linear()'s Function and its custom op
    without a graph break and add into main_grad what eager does, bit for bit; their weights' arrivals launch the
    same buckets in the same order during the last backward. 1F1B's order (a second forward before the first
    backward, as a pipeline stage runs) gives the sequential main_grads bit for bit: main_grad is not a saved
    tensor whose version autograd checks."""
    eager_launched, eager, _ = _bucket_launches_and_grads(False, False, monkeypatch)
    compiled_launched, compiled, breaks = _bucket_launches_and_grads(True, True, monkeypatch)
    assert breaks == 0
    assert all(torch.equal(compiled[n], eager[n]) for n in eager), [
        n for n in eager if not torch.equal(compiled[n], eager[n])
    ]
    assert compiled_launched == eager_launched and {phase for phase, _ in eager_launched} == {
        "backward 1"
    }
    assert len(eager_launched) > 4
