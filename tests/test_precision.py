"""Megatron's precision regime (precision.py): what is half, what stays fp32, and that it holds end to end.

Each test fails under the old autocast regime (fp32 weights, fp32 residual stream and pipeline messages, gradients
accumulated in the parameters' dtype)."""
import math
import os

import pytest
import torch

import arguments
import parallel
import precision
import train
from helpers import SMALL, corpus, losses, run_main  # noqa: F401 (corpus is a fixture)
from model import GPT, GPTConfig

PRECISIONS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}
HALF = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=512,
            make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0)


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
    model = train.build_model(cfg, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {HALF[name]}
    assert {p.main_grad.dtype for p in model.parameters()} == {precision.grad_dtype(cfg)}
    assert precision.grad_dtype(cfg) == (torch.float16 if name == "fp16" else torch.float32)
    block = model.blocks["0"]
    x = torch.randn(2, 8, cfg.hidden_size).to(HALF[name])
    assert block(x).dtype == HALF[name]  # the residual stream stays in the compute dtype
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    assert model.embed(ids).dtype == HALF[name]
    assert model(ids, ids).dtype == torch.float32  # the loss: cross-entropy in fp32


def test_layernorm_computes_in_fp32_and_returns_half():
    """PyTorch's LayerNorm takes its statistics in fp32 for half inputs (Megatron's fused LayerNorm does too)."""
    ln = torch.nn.LayerNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    x = (torch.randn(4, 64) * 30 + 200).to(torch.bfloat16)  # a large mean: bf16 statistics would be off
    out = ln(x)
    assert out.dtype == torch.bfloat16
    ref = torch.nn.functional.layer_norm(x.float(), (64,), ln.weight.float(), ln.bias.float(), 1e-5)
    assert torch.equal(out, ref.to(torch.bfloat16))
    centered = x - x.mean(-1, keepdim=True)  # the same formula with bf16 statistics
    in_bf16 = centered / (centered.square().mean(-1, keepdim=True) + 1e-5).sqrt() * ln.weight + ln.bias
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


def test_bf16_gradients_accumulate_in_fp32_over_64_micro_batches():
    """The GradBuffer's sum of 64 bf16 micro-batch gradients is their exact sum to fp32 rounding; summing them in
    bf16 (autograd's accumulation into a bf16 .grad, the old behaviour) is off by orders of magnitude more."""
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    model = GPT(cfg).to(torch.bfloat16)
    batches = [(torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))) for _ in range(64)]
    exact, in_bf16 = {}, {}
    for x, y in batches:  # every micro-batch's own bf16 gradient, summed in fp64 and in bf16
        model.zero_grad(set_to_none=True)
        (model(x, y) / 64).backward()
        for n, p in model.named_parameters():
            exact[n] = exact.get(n, 0) + p.grad.double()
            in_bf16[n] = in_bf16.get(n, 0) + p.grad
    model.zero_grad(set_to_none=True)
    buffer = parallel.attach_grad_buffer(model, torch.float32)
    buffer.start(64)
    for x, y in batches:
        (model(x, y) / 64).backward()
    parallel.reduce_gradients(model)

    def error(grads):
        return max(((grads[n].double() - exact[n]).norm() / exact[n].norm()).item() for n in exact)

    fp32_error, bf16_error = error({n: p.main_grad for n, p in model.named_parameters()}), error(in_bf16)
    assert fp32_error < 1e-6, fp32_error  # fp32 rounding of 64 additions
    assert bf16_error > 1e-3, bf16_error  # bf16 keeps 8 bits: the accumulation the buffer exists to avoid


def test_query_key_layer_scaling_defaults_to_megatrons():
    assert _cfg("--fp16").apply_query_key_layer_scaling is True
    assert _cfg("--bf16").apply_query_key_layer_scaling is False
    assert _cfg().apply_query_key_layer_scaling is False
    assert _cfg("--fp16", "--apply_query_key_layer_scaling=false").apply_query_key_layer_scaling is False
    assert _cfg("--apply_query_key_layer_scaling").apply_query_key_layer_scaling is True


def test_master_weights_are_fp32_and_round_into_the_model():
    cfg = _cfg("--bf16", "--lr=1e-2", "--vocab_size=512", "--seq_length=16")
    model = train.build_model(cfg, torch.device("cpu"))
    optimizer = train.build_optimizer(cfg, model)
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    assert {p.dtype for p in masters} == {torch.float32} and len(masters) == len(list(model.parameters()))
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length))
    for _ in range(3):
        train.train_step(model, optimizer, train.build_scaler(cfg), [(x, x)], 1e-3, cfg, torch.device("cpu"))
    state = optimizer.state_dict()
    assert all(s["exp_avg"].dtype == torch.float32 for s in state["state"].values())
    assert all(torch.equal(m, saved) for (_, m), saved in zip(optimizer.copies, state["fp32_master_weights"]))
    for p, master in optimizer.copies:  # the model holds the masters rounded to bf16
        assert torch.equal(p, master.to(torch.bfloat16))
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in state["fp32_master_weights"])


def test_bnb_8bit_state_lives_on_the_fp32_masters_with_the_embedding_32bit():
    pytest.importorskip("bitsandbytes")
    cfg = _cfg("--bf16", "--use_bnb_optimizer", "--vocab_size=512", "--seq_length=16")
    model = train.build_model(cfg, torch.device("cpu"))
    optimizer = train.build_optimizer(cfg, model)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length))
    train.train_step(model, optimizer, train.build_scaler(cfg), [(x, x)], 1e-3, cfg, torch.device("cpu"))
    master = dict((id(p), m) for p, m in optimizer.copies)
    embedding, fc1 = master[id(model.word_embedding_weight())], master[id(model.blocks["0"].mlp.fc1.weight)]
    assert embedding.dtype == fc1.dtype == torch.float32
    assert optimizer.state[embedding]["state1"].dtype == torch.float32  # lesson 14: the embedding stays 32-bit
    assert optimizer.state[fc1]["state1"].dtype == torch.uint8
