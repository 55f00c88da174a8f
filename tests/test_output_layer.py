"""The output layer's speed-related paths in cross_entropy.py, each against a reference: the matmuls on the padded
weight (a multiple of 128 rows on every TP rank, as cuBLAS's aligned kernels want) with the same numbers as plain
ops; the elementwise chain compiled with no graph break and the eager numbers; and the precision and no-gradient
cases a mutation audit found untested (a bf16 weight gradient over 64 chunks, an fp16 sum past 65504, evaluation
under no_grad doing no gradient matmul). GPT-2's real vocabulary (50257) throughout."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import cross_entropy
import parallel
from helpers import spawn
from model import GPTConfig

V_REAL, H = 50257, 16
MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.mm.out,
    torch.ops.aten.addmm.default,
    torch.ops.aten.addmm.out,
}


class MatmulShapes(TorchDispatchMode):
    """Records the (rows, inner, columns) of every matmul run under it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            a, b = (
                (args[0], args[1])
                if func.overloadpacket == torch.ops.aten.mm
                else (args[1], args[2])
            )
            self.shapes.append((a.shape[-2], a.shape[-1], b.shape[-1]))
        return func(*args, **(kwargs or {}))


def _inputs(tp, tokens=24, dtype=torch.float64, seed=0):
    """hidden (tokens x H), the whole padded output weight (the model's padding for this TP size: 50304 at TP 1,
    50432 at TP 2), its padding rows nonzero (a softmax over them would show), and targets at both ends."""
    g = torch.Generator().manual_seed(seed)
    padded = GPTConfig(vocab_size=V_REAL, tensor_model_parallel_size=tp).padded_vocab_size
    hidden = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    weight = 0.5 * torch.randn(padded, H, generator=g, dtype=torch.float64)
    weight[V_REAL:] = 0.1
    target = torch.randint(0, V_REAL, (tokens,), generator=g)
    target[0], target[-1] = 0, V_REAL - 1
    return hidden.to(dtype), weight.to(dtype), target


def _reference(hidden, weight, target, z_loss=1e-2):
    """F.cross_entropy on the real columns of the full logits, float64: (its mean, and the gradients of the mean
    plus the z-loss, which ours adds to the gradient and not to the value)."""
    hidden = hidden.detach().double().clone().requires_grad_()
    weight = weight.detach().double().clone().requires_grad_()
    logits = F.linear(hidden, weight)[:, :V_REAL]
    loss = F.cross_entropy(logits, target)
    (loss + z_loss * logits.logsumexp(-1).square().mean()).backward()
    return loss.detach(), hidden.grad, weight.grad


def _shapes_on_this_rank(tp):
    cross_entropy.CROSS_ENTROPY_CHUNK = 1  # 24 tokens in chunks of H = 16: a ragged last chunk too
    hidden, weight, target = _inputs(tp)
    expected = _reference(hidden, weight, target)
    mine = parallel.shard(weight, 0).clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    with MatmulShapes() as recorded:
        loss, _ = cross_entropy.linear_cross_entropy(
            parallel.copy_to_tp(h), mine, target, V_REAL, 1e-2, "mean"
        )
        loss.backward()
    rows = mine.shape[0]
    assert rows % 128 == 0, rows
    # per chunk: logits (tokens x H x rows), the weight's gradient (rows x tokens x H), the hidden's (tokens x rows x H)
    assert recorded.shapes == [
        s for n in (16, 8) for s in ((n, H, rows), (rows, n, H), (n, rows, H))
    ], recorded.shapes
    torch.testing.assert_close(loss, expected[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(h.grad, expected[1], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(mine.grad, parallel.shard(expected[2], 0), atol=1e-10, rtol=1e-10)
    # padding
    assert parallel.grid.tp_rank < parallel.grid.tp_size - 1 or not mine.grad[V_REAL % rows :].any()


def test_output_layer_matmuls_are_multiples_of_128_on_one_process():
    spawn(_shapes_on_this_rank, 1, 1, 1, 1)


def test_output_layer_matmuls_are_multiples_of_128_on_every_tp_rank():
    # TP 2: 25216 rows each (50432 / 2), the second rank's last 175 padding rows out of the softmax
    spawn(_shapes_on_this_rank, 2, 2, 1, 2)


def test_per_token_loss_on_the_padded_weight_equals_plain_ops(monkeypatch):
    # reduction "none": backward computes the logits again, over the padded weight as well, the padding masked
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 1)
    hidden, weight, target = _inputs(1)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with MatmulShapes() as recorded:
        loss, _ = cross_entropy.linear_cross_entropy(h, w, target, V_REAL, 1e-2)
        loss.mean().backward()
    # per chunk: logits, again in backward, and the two gradients
    assert len(recorded.shapes) == 2 * 4
    assert all(weight.shape[0] in shape for shape in recorded.shapes), recorded.shapes
    expected = _reference(hidden, weight, target)
    torch.testing.assert_close(loss.mean(), expected[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(h.grad, expected[1], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(w.grad, expected[2], atol=1e-10, rtol=1e-10)


# -- the elementwise chain compiled (cross_entropy.compile_chain, on where the run compiles) ---------------------


def _chain_args(dtype, tokens=24, seed=0):
    hidden, weight, target = _inputs(1, tokens, dtype, seed)
    logits = F.linear(hidden, weight)
    wide = torch.promote_types(dtype, torch.float32)
    outside = target >= V_REAL
    return logits, target, outside, wide


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chain_compiles_without_a_graph_break(dtype):
    logits, target, outside, wide = _chain_args(dtype)
    top = logits[:, :V_REAL].amax(-1).to(wide)
    calls = {
        "max": (logits, target, outside, V_REAL),
        "sum_exp": (logits, top, V_REAL),
        "logit_grad": (
            logits.clone(),
            top,
            torch.rand(len(top), dtype=wide),
            1.0,
            target,
            outside,
            V_REAL,
        ),
    }
    for name, fn in (
        ("max", cross_entropy.logits_max),
        ("sum_exp", cross_entropy.logits_sum_exp),
        ("logit_grad", cross_entropy.logits_grad),
    ):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(*calls[name])
        assert explained.graph_break_count == 0, (
            name,
            [str(b.reason)[:200] for b in explained.break_reasons],
        )
        assert explained.graph_count == 1, name


def _mean_and_grads(hidden, weight, target, z_loss=1e-2):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, log_z = cross_entropy.linear_cross_entropy(h, w, target, V_REAL, z_loss, "mean")
    loss.backward()
    return loss.detach(), log_z, h.grad, w.grad


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_compiled_chain_gives_the_eager_numbers(backend, monkeypatch):
    # aot_eager: the traced graph itself; inductor: its fused CPU kernels; both to fp32 rounding (eager takes the
    # softmax from torch's kernel, compiled from exp(logits - log Z): the same values, not the same operations)
    # 40 tokens in chunks of 16, 16 and 8
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 1)
    hidden, weight, target = _inputs(1, 40, torch.float32)
    eager = _mean_and_grads(hidden, weight, target)
    torch._dynamo.reset()
    cross_entropy.compile_chain(backend=backend)
    try:
        compiled = _mean_and_grads(hidden, weight, target)
    finally:
        cross_entropy.compile_chain(on=False)
    assert cross_entropy.chain.max is cross_entropy.logits_max  # put back
    for name, a, b in zip(("loss", "log Z", "grad hidden", "grad weight"), compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


# -- precision and no-gradient cases -----------------------------------------------------------------------------


@pytest.mark.slow  # ~50 s: bf16 matmuls over GPT-2's vocabulary on the CPU
def test_bf16_weight_gradient_over_64_chunks_is_as_close_as_the_logits_path(monkeypatch):
    # the weight's gradient summed over 64 chunks in fp32 (in bf16, its error would be ~4x the logits path's)
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 1)  # chunks of H = 16 tokens
    hidden, weight, target = _inputs(1, 64 * H, torch.bfloat16)
    # one row of the gradient summed over many tokens (half of them), in every chunk
    target[: 64 * H // 2] = 7
    exact = _reference(hidden, weight, target, 0.0)
    ours = _mean_and_grads(hidden, weight, target, 0.0)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ce, _ = parallel.vocab_parallel_cross_entropy(F.linear(h, w), target, V_REAL)
    ce.mean().backward()

    def error(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    ours_error, logits_error = error(ours[3], exact[2]), error(w.grad, exact[2])
    assert ours_error <= 1.5 * logits_error, (ours_error, logits_error)  # summed in bf16: 4-5x
    assert error(ours[2], exact[1]) <= 1.5 * error(h.grad, exact[1])


@pytest.mark.slow  # ~40 s: fp16 matmuls over GPT-2's vocabulary on the CPU
def test_fp16_weight_gradient_summed_past_65504_keeps_its_mean(monkeypatch):
    # every token's target is row 7 and its hidden states ~100: that row's gradient sums to ~-100 per token,
    # -102400 over 1024 tokens before the mean divides it back to ~-100 (fp16's largest number is 65504)
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 1)
    hidden, weight, target = _inputs(1, 64 * H, torch.float64)
    hidden = (100.0 + hidden).half()
    weight = (0.001 * weight).half()
    target[:] = 7
    exact = _reference(hidden, weight, target, 0.0)
    ours = _mean_and_grads(hidden, weight, target, 0.0)
    assert exact[2].abs().max() > 50 and exact[2].abs().max() * len(target) > 65504  # the premise
    assert ours[3].dtype == torch.float16 and ours[3].isfinite().all()
    torch.testing.assert_close(ours[3].double(), exact[2], atol=0.1, rtol=2e-3)
    torch.testing.assert_close(ours[0].double(), exact[0], atol=1e-2, rtol=1e-3)


def test_evaluation_under_no_grad_does_no_gradient_matmul():
    # weights that require grad (the model's), evaluated under no_grad: the logits' matmul alone
    hidden, weight, target = _inputs(1, 24, torch.float32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        loss, _ = cross_entropy.linear_cross_entropy(h, w, target, V_REAL, 1e-2, "mean")
    assert counter.get_total_flops() == 2 * len(target) * H * weight.shape[0]
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, _mean_and_grads(hidden, weight, target)[0])
