"""The stability levers qk_layernorm and z_loss (lesson 20) against references (the lab measures their LR
sensitivity: lab/tests/test_lr_sweep.py).

qk_layernorm against attention written out by hand; z_loss against torch.logsumexp on the full logits and its
gradient against autograd of the plain formula (GPT-2's real vocabulary); both under TP=2 against one process
(float64); through the trainer, the `z loss` field and an lm loss that excludes it.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import arguments
import parallel
from helpers import (  # noqa: F401
    SMALL,
    TINY,
    corpus,
    gather,
    log_fields,
    losses,
    random_batches,
    run_main,  # (corpus is a fixture)
    spawn,
)
from model import GPT, Attention, GPTConfig

NO_DROPOUT = ["--hidden_dropout=0", "--attention_dropout=0"]


# -----------------------------------------------------------------------------
# z_loss


def test_z_loss_value_and_gradient_match_the_plain_formula():
    gen = torch.Generator().manual_seed(0)
    # GPT-2's vocabulary; a coefficient large enough to move the gradient visibly
    V, c = 50257, 1e-2
    logits = (torch.randn(2, 3, V, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    target = torch.randint(0, V, (2, 3), generator=gen)
    loss, log_z = parallel.vocab_parallel_cross_entropy(logits, target, z_loss=c)
    torch.testing.assert_close(log_z, torch.logsumexp(logits.detach(), dim=-1), rtol=0, atol=1e-12)
    # the value is the cross-entropy alone (what the log calls lm loss) ...
    plain_ce = F.cross_entropy(
        logits.detach().flatten(0, 1), target.flatten(), reduction="none"
    ).view(2, 3)
    torch.testing.assert_close(loss.detach(), plain_ce, rtol=0, atol=1e-12)
    # ... the gradient is that of cross-entropy + c * log(Z)^2, through whatever reduction the caller applies
    loss.mean().backward()
    reference = logits.detach().clone().requires_grad_()
    (
        F.cross_entropy(reference.flatten(0, 1), target.flatten())
        + c * torch.logsumexp(reference, dim=-1).square().mean()
    ).backward()
    torch.testing.assert_close(logits.grad, reference.grad, rtol=1e-10, atol=1e-15)
    without = logits.detach().clone().requires_grad_()
    parallel.vocab_parallel_cross_entropy(without, target)[0].mean().backward()
    assert (without.grad - logits.grad).abs().max() > 1e-4  # the z-loss really is in the gradient


def test_model_keeps_the_z_loss_for_the_log_and_evaluates_without_it():
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        z_loss=1e-3,
    )
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    y = torch.roll(x, -1, dims=1)
    with torch.no_grad():
        # the columns the softmax sees
        log_z = torch.logsumexp(model(x).double()[..., : cfg.vocab_size], dim=-1)
    losses_ = [model(x, y) for _ in range(2)]  # two micro-batches
    z = model.pop_z_loss()
    assert math.isclose(z.item(), 1e-3 * log_z.square().mean().item(), rel_tol=1e-5)
    assert model.pop_z_loss().item() == 0.0  # popped
    model.eval()
    with torch.no_grad():
        # the same lm loss: the value never includes z
        assert torch.equal(model(x, y), losses_[0].detach())
    assert model.pop_z_loss().item() == 0.0  # evaluation adds no z-loss


def test_z_loss_is_logged_apart_from_the_lm_loss(corpus):
    args = [*SMALL, *NO_DROPOUT, "--train_iters=2", "--lr_warmup_samples=0", "--lr=1e-2"]
    plain = log_fields(run_main(*args))
    with_z = log_fields(run_main(*args, "--z_loss=1e-2"))
    assert "z loss" not in plain[1]
    # iteration 1 runs the same weights on the same batch: the same lm loss, the z-loss beside it
    assert with_z[1]["lm loss"] == plain[1]["lm loss"]
    z = float(with_z[1]["z loss"])
    # small logits: log Z ~ ln V
    assert 0.5 * 1e-2 * math.log(50257) ** 2 < z < 1.5 * 1e-2 * math.log(50257) ** 2
    assert with_z[2]["lm loss"] != plain[2]["lm loss"]  # ... and its gradient changed the update
    with pytest.raises(ValueError, match="z_loss"):
        arguments.validate(arguments.load_config([*SMALL, "--train_iters=1", "--z_loss=-1"]))
    with pytest.raises(ValueError, match="qk_layernorm with deepspeed"):
        cfg = arguments.load_config(
            [
                *SMALL,
                "--train_iters=1",
                "--qk_layernorm",
                "--deepspeed",
                "--bf16",
                "--tensor_model_parallel_size=2",
            ]
        )
        arguments.validate(cfg, world_size=2)


# -----------------------------------------------------------------------------
# qk_layernorm


def _perturb_qk_norms(model):
    """Non-trivial qk-layernorm weights and biases (init is 1 and 0), the same whatever the TP layout."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(
                    base
                    + torch.linspace(-0.3, 0.5, p.numel(), dtype=p.dtype)
                    + 0.1 * ("k_norm" in name)
                )


def test_qk_layernorm_matches_attention_written_out():
    torch.manual_seed(0)
    cfg = GPTConfig(
        hidden_size=32,
        num_attention_heads=4,
        seq_length=8,
        attention_dropout=0.0,
        qk_layernorm=True,
    )
    attn = Attention(cfg, 1, parallel.grid).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    B, T, H, D = 2, 8, 4, 8

    def layernorm(t, norm):  # over head_dim, one weight and bias shared by the heads
        mean = t.mean(-1, keepdim=True)
        var = ((t - mean) ** 2).mean(-1, keepdim=True)
        return (t - mean) / torch.sqrt(var + cfg.layernorm_epsilon) * norm.weight + norm.bias

    qkv = (x @ attn.qkv.weight.T + attn.qkv.bias).view(B, T, H, 3, D)
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D)
    q, k = layernorm(q, attn.q_norm), layernorm(k, attn.k_norm)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * D)
    expected = y @ attn.proj.weight.T + attn.proj.bias
    torch.testing.assert_close(attn(x), expected, rtol=1e-10, atol=1e-12)
    attn.q_norm = attn.k_norm = None  # the same weights without the switch compute something else
    assert (attn(x) - expected).abs().max() > 1e-3
    with_norms = GPTConfig(num_layers=3, hidden_size=32, num_attention_heads=4, qk_layernorm=True)
    assert sum(p.numel() for p in GPT(with_norms).parameters()) == with_norms.num_parameters(
        padded=True
    )


def _levers_tp_matches_one_process():
    """qk_layernorm and z_loss under TP=2 against one process, float64: loss, z-loss, every gradient."""
    g = parallel.grid
    torch.set_default_dtype(torch.float64)
    cfg = GPTConfig(**TINY, qk_layernorm=True, z_loss=0.1, tensor_model_parallel_size=g.tp_size)
    x, y = random_batches(0, 1, 2, 16, cfg.vocab_size)[0]

    def step():
        model = GPT(cfg)
        model.init_weights(1234)
        _perturb_qk_norms(model)
        loss = model(x, y)
        loss.backward()
        return model, loss.item(), model.pop_z_loss().item()

    real, parallel.grid = parallel.grid, parallel.Grid(1, 1, world_size=1, rank=0)
    try:
        reference, ref_loss, ref_z = step()
    finally:
        parallel.grid = real
    model, loss, z = step()
    parallel.reduce_gradients(model)  # sums the qk-layernorm gradients over TP
    assert math.isclose(loss, ref_loss, rel_tol=1e-12) and math.isclose(z, ref_z, rel_tol=1e-12), (
        loss,
        z,
    )
    assert z > 0.1 * loss  # the z-loss is large enough here that a wrong gradient would show
    ref_grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        expected = parallel.shard(ref_grads[name].grad, getattr(p, "tp_dim", None))
        torch.testing.assert_close(
            p.grad, expected, rtol=1e-5, atol=1e-12, msg=lambda m: f"{name}: {m}"
        )
        # the shared qk-layernorm weights: the same gradient on every TP rank, bit for bit
        if "_norm" in name:
            assert all(torch.equal(other, p.grad) for other in gather(p.grad, g.tp_group)), name


def test_qk_layernorm_and_z_loss_tp2_match_one_process():
    spawn(_levers_tp_matches_one_process, 2, 2, 1)
