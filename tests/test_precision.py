"""Megatron's precision regime (precision.py): what is half, what stays fp32, and that it holds end to end.

Each test fails under the old autocast regime (fp32 weights, fp32 residual stream and pipeline messages, gradients
accumulated in the parameters' dtype)."""

import copy
import io
import math

import pytest
import torch

import arguments
import model
import optim
import parallel
import precision
from builders import build_model, build_optimizer, step_rules
from helpers import SMALL, corpus, losses, run_main  # noqa: F401 (corpus is a fixture)
from model import GPT, GPTConfig
from training import whole_step

PRECISIONS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}
HALF = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TINY = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=512,
    make_vocab_size_divisible_by=128,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes: one intra-op thread is faster, and on a loaded machine 40x faster than two spinning."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cfg(*extra):
    return arguments.prepare(arguments.load_config([*SMALL, "--train_iters=1", *extra]))


@pytest.mark.parametrize("name", PRECISIONS)
def test_weights_and_block_output_are_in_the_compute_dtype(name):
    cfg = _cfg(*PRECISIONS[name])
    model = build_model(cfg, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {HALF[name]}
    assert {p.main_grad.dtype for p in model.parameters()} == {precision.grad_dtype(cfg)}
    assert precision.grad_dtype(cfg) == torch.float32  # fp16 too: its micro-batches summed in fp32
    block = model.blocks["0"]
    x = torch.randn(2, 8, cfg.hidden_size).to(HALF[name])
    assert block(x).dtype == HALF[name]  # the residual stream stays in the compute dtype
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    assert model.embed(ids).dtype == HALF[name]
    assert model(ids, ids).dtype == torch.float32  # the loss: cross-entropy in fp32


def test_layernorm_computes_in_fp32_and_returns_half():
    """PyTorch's LayerNorm takes its statistics in fp32 for half inputs (Megatron's fused LayerNorm does too)."""
    # seeded: bit-for-bit comparisons of drawn inputs, independent of order
    g = torch.Generator().manual_seed(0)
    ln = torch.nn.LayerNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        ln.weight.copy_(torch.randn(64, generator=g)), ln.bias.copy_(torch.randn(64, generator=g))
    # a large mean: bf16 statistics would be off
    x = (torch.randn(4, 64, generator=g) * 30 + 200).to(torch.bfloat16)
    out = ln(x)
    assert out.dtype == torch.bfloat16
    ref = torch.nn.functional.layer_norm(x.float(), (64,), ln.weight.float(), ln.bias.float(), 1e-5)
    assert torch.equal(out, ref.to(torch.bfloat16))
    centered = x - x.mean(-1, keepdim=True)  # the same formula with bf16 statistics
    in_bf16 = (
        centered / (centered.square().mean(-1, keepdim=True) + 1e-5).sqrt() * ln.weight + ln.bias
    )
    assert not torch.equal(out, in_bf16)


@pytest.mark.parametrize("name", PRECISIONS)
def test_pipeline_messages_are_in_the_compute_dtype(name, monkeypatch):
    """Stage 0 of 2 (a grid on paper; the messages are captured instead of sent): activations go out and their
    gradients come back in the compute dtype."""
    sent, received = [], []

    def communicate(send_next=None, send_prev=None, recv_prev=None, recv_next=None):
        sent.extend(t for t in (send_next, send_prev) if t is not None)
        for t in (recv_prev, recv_next):
            if t is not None:
                received.append(t)
                t.normal_(0, 1e-3)
        return recv_prev, recv_next

    monkeypatch.setattr(parallel, "communicate", communicate)
    monkeypatch.setattr(parallel, "grid", parallel.Grid(1, 2, world_size=2, rank=0))
    model = GPT(GPTConfig(**TINY), range(1), pre_process=True, post_process=False).to(HALF[name])
    parallel.attach_grad_buffer(model, torch.float32).start(3)
    batches = [(torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))) for _ in range(3)]
    parallel.pipeline_forward_backward(model, batches)
    assert len(sent) == 3 and len(received) == 3
    assert {t.dtype for t in sent + received} == {HALF[name]}
    assert all(p.main_grad.abs().sum() > 0 for p in model.parameters())  # the gradients did arrive


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_half_gradients_accumulate_in_fp32_over_64_micro_batches(name):
    """The GradBuffer a run builds (precision.grad_dtype) sums 64 half-precision micro-batch gradients to their
    exact sum within fp32 rounding; summing them in the half dtype (autograd's accumulation into a half .grad;
    for fp16 the old fp16 GradBuffer, Megatron's default) is off by orders of magnitude more."""
    torch.manual_seed(0)
    cfg, dtype = _cfg(*PRECISIONS[name]), HALF[name]
    model = GPT(GPTConfig(**TINY)).to(dtype)
    batches = [(torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))) for _ in range(64)]
    # fp16: a loss scale, as a run has, so that no micro-batch's gradient falls into fp16's subnormals
    scale = 1024.0 if name == "fp16" else 1.0
    exact, in_half = {}, {}
    for x, y in batches:  # every micro-batch's own half gradient, summed in the half dtype
        model.zero_grad(set_to_none=True)
        (model(x, y) * scale / 64).backward()
        for n, p in model.named_parameters():
            in_half[n] = in_half.get(n, 0) + p.grad
    model.zero_grad(set_to_none=True)
    # each micro-batch's gradient as a buffer receives it (the output layer's unrounded), summed in fp64
    reference = copy.deepcopy(model)
    buffer = parallel.attach_grad_buffer(reference, torch.float64)
    for x, y in batches:
        buffer.start(1)
        (reference(x, y) * scale / 64).backward()
        for n, p in reference.named_parameters():
            exact[n] = exact.get(n, 0) + p.main_grad.clone()
    buffer = parallel.attach_grad_buffer(model, precision.grad_dtype(cfg))
    buffer.start(64)
    for x, y in batches:
        (model(x, y) * scale / 64).backward()
    parallel.reduce_gradients(model)

    def error(grads):
        return max(((grads[n].double() - exact[n]).norm() / exact[n].norm()).item() for n in exact)

    buffer_error, half_error = (
        error({n: p.main_grad for n, p in model.named_parameters()}),
        error(in_half),
    )
    assert buffer_error < 1e-6, buffer_error  # fp32 rounding of 64 additions
    # bf16 keeps 8 bits, fp16 11: the accumulation the fp32 buffer exists to avoid
    assert half_error > (1e-3 if name == "bf16" else 1e-4), half_error


def test_an_fp16_overflow_in_one_micro_batch_survives_the_fp32_sum():
    """fp16's loss scaler reads the grad norm of the fp32 sum: one micro-batch whose fp16 gradients overflow (a
    loss scale of 2^40 for it alone) among finite ones leaves the sum and its norm not finite, so that the step is
    skipped; the same micro-batches at a scale of 1 give a finite norm."""
    cfg = _cfg("--fp16")
    model = build_model(cfg, torch.device("cpu"))
    buffer = parallel.grad_buffer(model)
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    for scale, finite in ((1.0, True), (2.0**40, False)):
        buffer.start(3)
        for i in range(3):
            (model(x, x) * (scale if i == 1 else 1.0)).backward()
        parallel.reduce_gradients(model)
        assert bool(parallel.grad_norm(model).isfinite()) == finite, scale
    assert {p.main_grad.dtype for p in model.parameters()} == {torch.float32}


def test_a_growth_step_is_unscaled_by_the_scale_its_gradients_carry(monkeypatch):
    """fp16's scaler grows after a clean window (here every step): the step that grows it was
    computed at the old scale and is unscaled by it, as Megatron's (unscale, then update), not by
    the grown one -- which would apply half of that step's gradient."""
    cfg = _cfg("--fp16", "--initial_loss_scale=1024", "--loss_scale_window=1")
    model = build_model(cfg, torch.device("cpu"))
    optimizer, scaler = build_optimizer(cfg, model), optim.scaler_for(cfg)
    divisors, prepare = [], optimizer.prepare_grads
    monkeypatch.setattr(optimizer, "prepare_grads", lambda s: divisors.append(s) or prepare(s))
    x = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        step = whole_step(model, optimizer, scaler, [(x, x)], 1e-3, step_rules(cfg), "cpu")
        assert step.outcome == "ok"
    assert scaler.scale == 4096 and divisors == [1024, 2048]


def test_query_key_layer_scaling_defaults_to_megatrons():
    assert _cfg("--fp16").apply_query_key_layer_scaling is True
    assert _cfg("--bf16").apply_query_key_layer_scaling is False
    assert _cfg().apply_query_key_layer_scaling is False
    assert (
        _cfg("--fp16", "--apply_query_key_layer_scaling=false").apply_query_key_layer_scaling
        is False
    )
    assert _cfg("--apply_query_key_layer_scaling").apply_query_key_layer_scaling is True


def test_master_weights_are_fp32_and_round_into_the_model():
    cfg = _cfg("--bf16", "--lr=1e-2", "--vocab_size=512", "--seq_length=16")
    model = build_model(cfg, torch.device("cpu"))
    optimizer = build_optimizer(cfg, model)
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    assert {p.dtype for p in masters} == {torch.float32} and len(masters) == len(
        list(model.parameters())
    )
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length))
    for _ in range(3):
        whole_step(
            model,
            optimizer,
            optim.scaler_for(cfg),
            [(x, x)],
            1e-3,
            step_rules(cfg),
            torch.device("cpu"),
        )
    state = optimizer.state_dict()
    assert all(s["exp_avg"].dtype == torch.float32 for s in state["state"].values())
    for (
        p,
        master,
    ) in optimizer.copies:  # the model holds the masters rounded to bf16, in storage of its own
        assert torch.equal(p, master.to(torch.bfloat16)) and p.data_ptr() != master.data_ptr()
    masters = [m.clone() for _, m in optimizer.copies]
    # more bits than the weights
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)
    # the saved masters are what a fresh optimizer resumes from, not the weights' bf16 values widened
    buffer = io.BytesIO()
    torch.save(state, buffer)
    fresh = build_optimizer(cfg, build_model(cfg, torch.device("cpu")))
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    assert all(torch.equal(m, saved) for (_, m), saved in zip(fresh.copies, masters))
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in fresh.copies)


def test_bnb_8bit_state_lives_on_the_fp32_masters_with_the_embedding_32bit():
    pytest.importorskip("bitsandbytes")
    cfg = _cfg("--bf16", "--use_bnb_optimizer", "--vocab_size=512", "--seq_length=16")
    model = build_model(cfg, torch.device("cpu"))
    optimizer = build_optimizer(cfg, model)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length))
    whole_step(
        model,
        optimizer,
        optim.scaler_for(cfg),
        [(x, x)],
        1e-3,
        step_rules(cfg),
        torch.device("cpu"),
    )
    master = dict((id(p), m) for p, m in optimizer.copies)
    embedding, fc1 = (
        master[id(model.word_embedding_weight())],
        master[id(model.blocks["0"].mlp.fc1.weight)],
    )
    assert embedding.dtype == fc1.dtype == torch.float32
    # lesson 14: the embedding stays 32-bit
    assert optimizer.state[embedding]["state1"].dtype == torch.float32
    assert optimizer.state[fc1]["state1"].dtype == torch.uint8


# -----------------------------------------------------------------------------
# The attention softmax is computed in fp32 from half inputs, on every path

# half an ulp at 1: the relative rounding of a value
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _peaked_qkv(dtype, score, device):
    """Half q, k, v (batch 1, 2 heads, 16 positions, head_dim 8) whose scores q.k/sqrt(8) are all near `score`
    (feature 0 of q and k carries it) and differ by about 1 (the other features): half-precision rounding of
    scores that large is as big as their differences, so only an fp32 softmax gets the weights right."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 2, 16, 8, generator=g)
    q[..., 0] = k[..., 0] = math.sqrt(score * math.sqrt(8))
    v = torch.randn(1, 2, 16, 8, generator=g)
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device)


def _softmax_attention(scores, v, bias=None):
    """softmax(scores + bias) v of the given scores (causal unless bias, which carries the mask), in their dtype."""
    T = scores.shape[-1]
    if bias is None:
        scores = scores.masked_fill(
            ~torch.ones(T, T, dtype=torch.bool, device=scores.device).tril(), float("-inf")
        )
    else:
        scores = scores + bias.to(scores.dtype)
    return scores.softmax(dim=-1).to(v.dtype) @ v


PATHS = {  # core_attention's keywords: the fused (SDPA) path, or Megatron's explicit one with its layer scaling
    "fused": {},
    "fused-stable": dict(stable=True),
    "fused-alibi": dict(bias=True),
    "unfused": dict(layer_scaling=3.0, unfused=True),
    "unfused-stable": dict(layer_scaling=3.0, stable=True, unfused=True),
    "unfused-alibi": dict(layer_scaling=3.0, bias=True, unfused=True),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("path", PATHS)
def test_attention_softmax_is_fp32_on_every_path(path, dtype, device):
    """What each path rounds to half by design is rounded here too (the stable variant's scaled q and k, the
    explicit path's scores from baddbmm, the fused path's float mask); everything after -- scaling the scores back
    up, adding ALiBi's bias, the softmax -- must be the fp64 result to the rounding of the probabilities and of the
    output (half an ulp each, of |v| at most: tolerance 2 x 2^-8 |v| in bf16, 2 x 2^-11 |v| in fp16). The same
    formula with the scores kept in half is checked to miss by 8x that."""
    kw = dict(PATHS[path])
    q, k, v = _peaked_qkv(dtype, 300.0, device)
    D, coeff = q.shape[-1], kw.get("layer_scaling") or 1.0
    bias = None
    if kw.pop("bias", False):
        bias = model.alibi_bias(model.alibi_slopes(2, device=device), 16, device=device)
        # as build_positions gives it: the fused path's mask in the input dtype (CUDA's SDPA takes no other)
        kw["bias"] = bias = bias.to(dtype) if coeff == 1.0 else bias
    out = model.core_attention(q, k, v, **kw)
    if kw.get("stable"):
        s = (D**0.5 * coeff) ** -0.5 if coeff != 1.0 else D**-0.25
        q, k, alpha = q * s, k * s, 1.0
    else:
        alpha = 1.0 / (D**0.5 * coeff)
    if coeff == 1.0:  # SDPA multiplies and accumulates in fp32
        scores = (q.double() @ k.double().transpose(-1, -2)) * alpha
    else:  # Megatron's baddbmm in the input dtype, scaled down by the layer number
        scores = (q.float() @ k.float().transpose(-1, -2) * alpha).to(dtype).double()
    reference = _softmax_attention(scores * coeff, v.double(), bias)
    tolerance = 2 * EPS[dtype] * v.abs().max().item()
    error = (out.double() - reference).abs().max().item()
    assert error <= tolerance, (error, tolerance)
    # the scores kept in the input dtype
    in_half = _softmax_attention(scores.to(dtype) * coeff, v, bias)
    # the inputs can tell the two apart
    assert (in_half.double() - reference).abs().max().item() > 8 * tolerance


def test_an_fp16_resume_of_a_bf16_run_starts_its_loss_scale_at_the_initial_one(corpus, tmp_path):
    """The bf16 run's scaler is the static no-op one: loaded into fp16's dynamic scaler, its scale 1 trained the
    fp16 run on gradients that underflow, for the 1,000 clean steps before it doubles."""
    from helpers import log_fields

    save = tmp_path / "run"
    run_main(
        *SMALL, "--bf16", "--train_iters=1", f"--save={save}", "--eval_iters=0", "--sample_tokens=0"
    )
    out = run_main(
        *SMALL,
        "--fp16",
        "--apply_query_key_layer_scaling=false",  # fp16's default: another function of the same weights
        "--train_iters=2",
        f"--save={save}",
        "--eval_iters=0",
        "--sample_tokens=0",
        "--log_interval=1",
    )
    assert (
        "loss scale: the checkpoint's run had no dynamic loss scale; it starts at initial_loss_scale 4.29497e+09"
        in out
    )
    assert float(log_fields(out)[2]["loss scale"]) >= 2.0**31
