"""cross_entropy.linear_cross_entropy: the output layer and the vocab-parallel cross-entropy without the logits.
Against the plain ops (F.linear, F.cross_entropy, autograd of the z-loss) in float64 with the real GPT-2
vocabulary (50257, padded), under TP 1 and TP 2; against today's logits path in the model; and never holding a
(tokens x vocabulary) tensor."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import cross_entropy
import parallel
from helpers import spawn
from model import GPT, GPTConfig

V_REAL, V_PADDED, H = 50257, 50304, 16


def _inputs(dtype=torch.float64, B=2, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (0.5 * torch.randn(V_PADDED, H, generator=g, dtype=torch.float64)).to(dtype)
    weight[V_REAL:] = 0.0  # the model's padded rows
    target = torch.randint(0, V_REAL, (B, T), generator=g)
    target[0, 0], target[-1, -1] = 0, V_REAL - 1  # the first and last real columns
    return hidden, weight, target


def _reference(hidden, weight, target, z_loss, weights):
    """Plain ops on the real columns: (loss, log Z, grad of hidden, grad of weight) of sum(weights * (ce + z))."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(hidden, weight)[..., :V_REAL]
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(
        target.shape
    )
    log_z = logits.logsumexp(dim=-1)
    (weights * (ce + z_loss * log_z.square())).sum().backward()
    return ce.detach(), log_z.detach(), hidden.grad, weight.grad


def _ours(hidden, weight, target, z_loss, weights):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, log_z = cross_entropy.linear_cross_entropy(hidden, weight, target, V_REAL, z_loss)
    (weights * loss).sum().backward()
    return loss.detach(), log_z, hidden.grad, weight.grad


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
# one chunk, or ragged chunks of 1000 columns
@pytest.mark.parametrize("chunk", [2**22, 12 * 1000 + 7])
def test_equals_plain_ops_in_float64(z_loss, chunk, monkeypatch):
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", chunk)
    hidden, weight, target = _inputs()
    weights = torch.arange(1.0, target.numel() + 1, dtype=torch.float64).view(target.shape)
    ours, expected = (
        _ours(hidden, weight, target, z_loss, weights),
        _reference(hidden, weight, target, z_loss, weights),
    )
    for name, a, b in zip(("loss", "log Z", "grad hidden", "grad weight"), ours, expected):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)
    assert ours[3][V_REAL:].abs().max() == 0  # padding: no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_logits_path_to_rounding(dtype, monkeypatch):
    # today's path: F.linear then vocab_parallel_cross_entropy on the logits
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 12 * 4096)
    hidden, weight, target = _inputs(dtype)
    weights = torch.rand(target.shape, generator=torch.Generator().manual_seed(1))
    ours = _ours(hidden, weight, target, 1e-3, weights)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, log_z = parallel.vocab_parallel_cross_entropy(F.linear(h, w), target, V_REAL, 1e-3)
    (weights * loss).sum().backward()
    # fp32: sums over 50k columns in another order; bf16: the gradient rounds to bf16 in both
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for a, b in zip(ours, (loss, log_z, h.grad, w.grad)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op creates."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_model_never_holds_the_logits(monkeypatch):
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 2**18)  # 2048 columns per chunk
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        seq_length=64,
        vocab_size=V_REAL,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        z_loss=1e-4,
    )
    gpt = GPT(cfg)
    ids = torch.randint(0, V_REAL, (2, 64), generator=torch.Generator().manual_seed(0))
    with LargestTensor() as mode:
        gpt(ids, targets=ids).backward()
    tokens_x_vocab = ids.numel() * cfg.padded_vocab_size
    # the weight (and its gradient)
    assert mode.largest <= cfg.padded_vocab_size * H < tokens_x_vocab / 4
    # and the same loss and gradients as through the logits
    loss = gpt(ids, targets=ids)
    grads = torch.autograd.grad(loss, list(gpt.parameters()))
    logits = gpt(ids)
    ce, _ = parallel.vocab_parallel_cross_entropy(logits, ids, V_REAL, 1e-4)
    torch.testing.assert_close(loss, ce.mean(), atol=1e-6, rtol=1e-6)
    for a, b in zip(grads, torch.autograd.grad(ce.mean(), list(gpt.parameters()))):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _tp2_equals_plain_ops(z_loss):
    hidden, weight, target = _inputs()
    weights = torch.arange(1.0, target.numel() + 1, dtype=torch.float64).view(target.shape)
    expected = _reference(hidden, weight, target, z_loss, weights)
    mine = parallel.shard(weight, 0).clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    loss, log_z = cross_entropy.linear_cross_entropy(
        parallel.copy_to_tp(h), mine, target, V_REAL, z_loss
    )
    (weights * loss).sum().backward()
    torch.testing.assert_close(loss, expected[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(log_z, expected[1], atol=1e-10, rtol=1e-10)
    # copy_to_tp's all-reduce
    torch.testing.assert_close(h.grad, expected[2], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(mine.grad, parallel.shard(expected[3], 0), atol=1e-10, rtol=1e-10)


def test_tensor_parallel_2_equals_one_process():
    # TP 1 equals the plain ops (above); TP 2, each rank with 25152 columns (the second with the 47 padding ones)
    spawn(_tp2_equals_plain_ops, 2, 2, 1, 1e-2)


def test_megatrons_padded_softmax_is_a_switch():
    # padded_vocab_in_softmax: the padding columns (zero rows here: logit 0) take part in the softmax, as Megatron
    hidden, weight, target = _inputs()
    cfg = dict(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        seq_length=6,
        vocab_size=V_REAL,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    ours, megatron = (
        GPT(GPTConfig(**cfg)).double(),
        GPT(GPTConfig(**cfg, padded_vocab_in_softmax=True)).double(),
    )
    assert not ours.embed.word.weight[V_REAL:].any()  # ours: the padded rows start at zero
    assert megatron.embed.word.weight[V_REAL:].abs().min() > 0  # Megatron's: drawn like the others
    megatron.load_state_dict(ours.state_dict())
    x = torch.randint(0, V_REAL, (2, 6), generator=torch.Generator().manual_seed(3))
    logits = ours(x)
    masked = F.cross_entropy(logits[..., :V_REAL].flatten(0, 1), x.flatten())
    full = F.cross_entropy(logits.flatten(0, 1), x.flatten())
    assert full > masked + 1e-6  # 47 more columns at logit 0 take some probability
    torch.testing.assert_close(ours(x, targets=x), masked, atol=1e-12, rtol=0)
    torch.testing.assert_close(megatron(x, targets=x), full, atol=1e-12, rtol=0)
    megatron(x, targets=x).backward()
    # the padded rows learn, as Megatron's
    assert megatron.embed.word.weight.grad[V_REAL:].abs().max() > 0


@pytest.mark.cuda
def test_gpt2_output_layer_peak_memory_on_cuda():
    """gpt2_125m's micro-batch (16 x 1024 tokens, bf16): the logits path held 6 bytes per logit (4.6 GiB: bf16
    logits and their fp32 copy); the fused loss about 10 bytes per element of one chunk (512 MiB of fp32 logits)
    plus the weight's gradient, fp32 while it sums the chunks (~1 GiB)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(16, 1024, 768, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (
        (0.02 * torch.randn(50304, 768, device="cuda", generator=g)).bfloat16().requires_grad_()
    )
    target = torch.randint(0, 50257, (16, 1024), device="cuda", generator=g)
    peaks = []
    for path in ("logits", "chunked"):
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if path == "logits":
            loss, _ = parallel.vocab_parallel_cross_entropy(F.linear(hidden, weight), target, 50257)
        else:
            loss, _ = cross_entropy.linear_cross_entropy(
                hidden, weight, target, 50257, reduction="mean"
            )
        loss.mean().backward()
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
    print(f"peak above the inputs: logits path {peaks[0]:.2f} GiB, chunked {peaks[1]:.2f} GiB")
    assert peaks[0] > 4.5 and peaks[1] < 1.2


# -- the model's path: reduction="mean", its gradient computed in the forward ----------------------------------


def _reference_mean(hidden, weight, target, z_loss, vocab, upstream=3.0):
    """F.cross_entropy on the full logits (the first `vocab` columns): (mean loss, log Z, grad hidden, grad weight)
    of upstream * (mean ce + z_loss * mean log(Z)^2)."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(hidden, weight)[..., :vocab]
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    log_z = logits.logsumexp(dim=-1)
    (upstream * (ce + z_loss * log_z.square().mean())).backward()
    return ce.detach(), log_z.detach(), hidden.grad, weight.grad


def _ours_mean(hidden, weight, target, z_loss, vocab, upstream=3.0):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, log_z = cross_entropy.linear_cross_entropy(
        hidden, weight, target, vocab, z_loss, reduction="mean"
    )
    (upstream * loss).backward()
    return loss.detach(), log_z, hidden.grad, weight.grad


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("vocab", [V_REAL, None])  # the padding masked; Megatron's softmax over it
# 48 tokens in one chunk, or in chunks of H = 16 (the least)
@pytest.mark.parametrize("chunk", [2**22, 1])
def test_mean_equals_f_cross_entropy_on_the_logits(z_loss, vocab, chunk, monkeypatch):
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", chunk)
    hidden, weight, target = _inputs(T=24)
    weight[V_REAL:] = 0.1  # padding rows that a softmax over them would notice
    ours = _ours_mean(hidden, weight, target, z_loss, vocab)
    expected = _reference_mean(hidden, weight, target, z_loss, vocab or V_PADDED)
    for name, a, b in zip(("loss", "log Z", "grad hidden", "grad weight"), ours, expected):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)
    # padding rows: a gradient only in the softmax
    assert (ours[3][V_REAL:].abs().max() == 0) == (vocab == V_REAL)


def test_the_gradient_is_computed_once_and_only_when_wanted():
    # FLOPs of the matmuls: logits, then their products with the weight and the hidden states -- three for the mean
    # (none again in backward), one without a gradient, four for the per-token loss (its backward recomputes)
    hidden, weight, target = _inputs(torch.float32)
    # the padded weight's rows: aligned matmuls, the padding masked
    matmul = 2 * target.numel() * H * V_PADDED

    def flops(reduction, grad=True):
        h, w = hidden.clone().requires_grad_(grad), weight.clone().requires_grad_(grad)
        with FlopCounterMode(display=False) as counter:
            loss, _ = cross_entropy.linear_cross_entropy(h, w, target, V_REAL, reduction=reduction)
            if grad:
                loss.sum().backward()
        return counter.get_total_flops() / matmul

    assert (flops("mean"), flops("mean", grad=False), flops("none")) == (3, 1, 4)
    with torch.no_grad():
        h = hidden.clone().requires_grad_()
        loss, _ = cross_entropy.linear_cross_entropy(h, weight, target, V_REAL, reduction="mean")
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, _ours_mean(hidden, weight, target, 0.0, V_REAL)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# chunks of 20, 20 and 8 tokens (an fp32 sum), or one
@pytest.mark.parametrize("chunk", [20 * V_PADDED, 2**22])
def test_mean_is_as_close_to_float64_as_the_logits_path(dtype, chunk, monkeypatch):
    # fp16 with a loss scale's upstream gradient (2^16): the weight's gradient is held in fp32 until it is applied
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", chunk)
    hidden, weight, target = _inputs(dtype, T=24)
    upstream = 2.0**16 if dtype == torch.float16 else 1.0
    exact = _reference_mean(hidden.double(), weight.double(), target, 1e-3, V_REAL, upstream)
    ours = _ours_mean(hidden, weight, target, 1e-3, V_REAL, upstream)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, log_z = parallel.vocab_parallel_cross_entropy(F.linear(h, w), target, V_REAL, 1e-3)
    (upstream * loss.mean()).backward()

    def error(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    for name, a, b, e in zip(
        ("loss", "log Z", "grad hidden", "grad weight"),
        ours,
        (loss.mean(), log_z, h.grad, w.grad),
        exact,
    ):
        assert a.dtype == b.dtype, name
        # bf16: 1e-3 both, fp16: 3e-4 ours, 6e-4 theirs; fp32: up to 2e-5, sums over 50k columns in fp32 in
        # another order (the CPU's matmul of a few rows sums them one by one)
        assert error(a, e) <= max(1.5 * error(b, e), 1e-4), name


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_per_token_loss_in_several_chunks_equals_plain_ops(z_loss, monkeypatch):
    # reduction "none" (its backward computes the logits again) with 48 tokens in chunks of H = 16
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 1)
    hidden, weight, target = _inputs(T=24)
    weights = torch.arange(1.0, target.numel() + 1, dtype=torch.float64).view(target.shape)
    ours, expected = (
        _ours(hidden, weight, target, z_loss, weights),
        _reference(hidden, weight, target, z_loss, weights),
    )
    for name, a, b in zip(("loss", "log Z", "grad hidden", "grad weight"), ours, expected):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_and_accumulation_count_the_weight_once(reentrant, monkeypatch):
    # a forward run again in backward (activation checkpointing around the loss) and two micro-batches'
    # backwards into the same .grad: the gradients of the sum of the two means, nothing twice
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 1)  # chunks of H = 16 tokens
    hidden, weight, target = _inputs(T=24)
    hidden2, _, target2 = _inputs(T=24, seed=1)
    expected = [
        sum(pair)
        for pair in zip(
            _reference_mean(hidden, weight, target, 1e-2, V_REAL, 1.0)[2:],
            _reference_mean(hidden2, weight, target2, 1e-2, V_REAL, 1.0)[2:],
        )
    ]
    w = weight.clone().requires_grad_()
    hs = [hidden.clone().requires_grad_(), hidden2.clone().requires_grad_()]
    for h, t in zip(hs, (target, target2)):
        loss = torch.utils.checkpoint.checkpoint(
            lambda h, w: cross_entropy.linear_cross_entropy(
                h, w, t, V_REAL, 1e-2, reduction="mean"
            )[0],
            h,
            w,
            use_reentrant=reentrant,
        )
        loss.backward()
    torch.testing.assert_close(hs[0].grad + hs[1].grad, expected[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(w.grad, expected[1], atol=1e-10, rtol=1e-10)


def _tp2_mean_equals_f_cross_entropy(z_loss):
    hidden, weight, target = _inputs(T=24)
    weight[V_REAL:] = 0.1
    cross_entropy.CROSS_ENTROPY_CHUNK = 1  # 48 tokens in chunks of H = 16, each all-reduced
    for vocab in (V_REAL, None):  # the padding masked; Megatron's softmax over it
        expected = _reference_mean(hidden, weight, target, z_loss, vocab or V_PADDED)
        mine = parallel.shard(weight, 0).clone().requires_grad_()
        h = hidden.clone().requires_grad_()
        loss, log_z = cross_entropy.linear_cross_entropy(
            parallel.copy_to_tp(h), mine, target, vocab, z_loss, "mean"
        )
        (3.0 * loss).backward()
        for name, a, b in zip(
            ("loss", "log Z", "grad hidden", "grad weight"),
            (loss, log_z, h.grad, mine.grad),
            expected[:3] + (parallel.shard(expected[3], 0),),
        ):
            torch.testing.assert_close(
                a, b, atol=1e-10, rtol=1e-10, msg=f"{name}, vocab_size {vocab}"
            )


def test_tensor_parallel_2_mean_equals_f_cross_entropy():
    # TP 2 over gloo at GPT-2's vocabulary: each rank 25152 columns, the second with the 47 padding ones
    spawn(_tp2_mean_equals_f_cross_entropy, 2, 2, 1, 1e-2)
