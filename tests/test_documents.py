"""Megatron's data flags for packed documents -- reset_position_ids, reset_attention_mask, eod_mask_loss -- from the
tokens to the loss: layers.packed_inputs against a transcription of Megatron's per-sample loop
(get_ltor_masks_and_position_ids), forward_backward against each document run alone (float64, loss and
every gradient), the loss mask counted by hand, and TP2 / PP2 (forward_backward's pipeline schedule) against
one process with the flags on. The model's side (the block-diagonal mask for every attention variant) is
tested in test_llama.py.
"""

import itertools
import math
import re
import types

import pytest
import torch
import torch.nn.functional as F

import arguments
import layers
import loader
import parallel
from helpers import random_batches, spawn, stage
from model import GPT, GPTConfig
from sections import section
from training import forward_backward

EOD = 0
BLOCK = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=50,
    make_vocab_size_divisible_by=32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
FLAGS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


def megatron_masks(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron-LM's get_ltor_masks_and_position_ids, its loops kept: (attention mask, True = may attend,
    loss mask, position ids)."""
    b, t = data.shape
    attention = torch.tril(torch.ones(b if reset_attention_mask else 1, t, t))
    loss_mask = torch.ones(b, t)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    positions = torch.arange(t).unsqueeze(0).expand(b, t).clone()
    for row in range(b):
        previous = 0
        for i in [int(i) for i in torch.nonzero(data[row] == eod)]:
            if reset_attention_mask:
                attention[row, i + 1 :, : i + 1] = 0
            if reset_position_ids:
                positions[row, i + 1 :] -= i + 1 - previous
                previous = i + 1
    return attention.expand(b, t, t) > 0.5, loss_mask, positions


def packed_tokens(seed=0, shape=(3, 16)):
    tokens = torch.randint(1, 50, shape, generator=torch.Generator().manual_seed(seed))
    tokens[0, [3, 9]] = EOD
    tokens[1, [0, 6, 7, 15]] = EOD  # a leading eod, two in a row, one at the end
    return tokens  # row 2: one document


@pytest.mark.parametrize("flags", list(itertools.product((False, True), repeat=3)))
def test_packed_inputs_are_megatrons(flags):
    """Every combination of the three flags: mask, positions and loss mask as Megatron's loop makes them."""
    tokens = packed_tokens()
    attention, loss_mask, positions = megatron_masks(tokens, EOD, *flags)
    inputs = layers.packed_inputs(tokens, EOD, **dict(zip(FLAGS, flags)))
    reset_positions, reset_mask, mask_loss = flags
    assert set(inputs) == {
        name for name, on in zip(("positions", "documents", "loss_mask"), flags) if on
    }
    if reset_mask:
        assert torch.equal(layers.document_mask(inputs["documents"])[:, 0], attention)
    if reset_positions:
        assert torch.equal(inputs["positions"], positions)
    if mask_loss:
        assert torch.equal(inputs["loss_mask"], loss_mask)


@pytest.fixture
def float64():
    """float64 by default: forward_backward's loss accumulator too."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def flagged(**flags):
    """The data keys forward_backward reads, with the end-of-document id EOD (monkeypatched eod_token)."""
    return types.SimpleNamespace(
        **{name: flags.get(name, False) for name in FLAGS}, tokenizer_file=None
    )


def test_a_packed_batch_trains_as_each_document_alone(monkeypatch, float64):
    """forward_backward with all three flags: the loss and every gradient of a packed batch equal those of
    each document run alone from position 0 (learned positions: a position not reset would show), the losses of
    the tokens after an eod left out and the rest averaged per micro-batch (float64)."""
    monkeypatch.setattr(loader, "eod_token", lambda cfg: EOD)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**BLOCK))
    x = packed_tokens()
    y = torch.randint(1, 50, x.shape, generator=torch.Generator().manual_seed(1))
    batches = [(x[:2], y[:2]), (x[2:], y[2:])]
    cfg = flagged(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    loss = forward_backward(model, batches, loader.packing(cfg), torch.device("cpu"))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    reference = 0.0
    for xs, ys in batches:
        total, count = 0.0, 0
        for row in range(xs.shape[0]):
            ends = [i + 1 for i in torch.nonzero(xs[row] == EOD).flatten().tolist()]
            for a, b in zip([0] + ends, ends + [xs.shape[1]]):
                if a == b:
                    continue
                # the document alone, from position 0
                logits = model(xs[row : row + 1, a:b])[0, :, :50]
                keep = xs[row, a:b] != EOD
                total = total + F.cross_entropy(logits[keep], ys[row, a:b][keep], reduction="sum")
                count += int(keep.sum())
        reference = reference + total / count / len(batches)
    reference.backward()
    assert math.isclose(loss.item(), reference.item(), rel_tol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}"
        )


def test_the_loss_mask_is_counted_as_megatron_counts_it(monkeypatch, float64):
    """eod_mask_loss: sum(loss * mask) / sum(mask) over the micro-batch's tokens (not a mean of per-sample means),
    0 where the *input* is the eod; the masks written out by hand."""
    monkeypatch.setattr(loader, "eod_token", lambda cfg: EOD)
    model = GPT(GPTConfig(**BLOCK)).eval()
    x = torch.tensor([[5, 0, 7, 0, 0, 3], [9, 9, 9, 9, 9, 0]])
    y = torch.tensor([[0, 7, 0, 0, 3, 4], [9, 9, 9, 9, 0, 2]])
    mask = torch.tensor([[1, 0, 1, 0, 0, 1], [1, 1, 1, 1, 1, 0]])  # 8 tokens count
    with torch.no_grad():
        # real columns
        per_token = F.cross_entropy(model(x)[..., :50].transpose(1, 2), y, reduction="none")
        loss = forward_backward(
            model, [(x, y)], loader.packing(flagged(eod_mask_loss=True)), "cpu", forward_only=True
        )
    assert math.isclose(loss.item(), (per_token * mask).sum().item() / 8, rel_tol=1e-12)
    assert not math.isclose(loss.item(), per_token.mean().item(), rel_tol=1e-6)


def test_reset_positions_alone_still_attend_across_documents(monkeypatch, float64):
    """reset_position_ids without reset_attention_mask (Megatron allows it): positions restart, attention crosses
    the documents -- rotary turned by each token's position in its document, in every layer."""
    monkeypatch.setattr(loader, "eod_token", lambda cfg: EOD)
    model = GPT(GPTConfig(**BLOCK, position_embedding_type="rotary", init_method_std=0.5)).eval()
    model.init_weights(1234)  # weights large enough for attention to tell positions apart
    x = packed_tokens()
    _, _, positions = megatron_masks(x, EOD, True, False, False)
    with torch.no_grad():
        packing = loader.packing(flagged(reset_position_ids=True))
        loss = forward_backward(model, [(x, x)], packing, "cpu", forward_only=True)
        assert math.isclose(loss.item(), model(x, x, positions=positions).item(), rel_tol=1e-12)
        assert not math.isclose(loss.item(), model(x, x).item(), rel_tol=1e-6)
        masked = model(x, x, positions=positions, documents=layers.document_ids(x, EOD)).item()
        assert not math.isclose(loss.item(), masked, rel_tol=1e-6)


# -----------------------------------------------------------------------------
# TP2 and PP2 equal one process, the flags on


LAYOUT_FLAGS = [  # rotary, so that positions matter in every layer of every stage
    dict(reset_position_ids=True, eod_mask_loss=True),
    dict(reset_attention_mask=True),
]


def _layout_with_flags():
    loader.eod_token = lambda cfg: EOD  # a spawned process: no monkeypatch
    g = parallel.grid
    torch.set_default_dtype(torch.float64)
    cfg = GPTConfig(
        **{**BLOCK, "num_layers": 4},
        position_embedding_type="rotary",
        num_query_groups=2,
        tensor_model_parallel_size=g.tp_size,
    )
    batches = random_batches(0, 3, 2, 16, cfg.vocab_size)
    for x, _ in batches:
        x[:, [2, 7, 8]] = EOD
    for flags in LAYOUT_FLAGS:
        real, parallel.grid = parallel.grid, parallel.Grid(1, 1, world_size=1, rank=0)
        try:
            one = GPT(cfg)
            one.init_weights(1234)
            packing = loader.packing(flagged(**flags))
            ref_loss = forward_backward(one, batches, packing, "cpu").item()
        finally:
            parallel.grid = real
        model = stage(cfg)
        parallel.attach_grad_buffer(model, torch.float64)
        parallel.grad_buffer(model).start(len(batches))
        packing = loader.packing(flagged(**flags))
        loss = parallel.average_loss(forward_backward(model, batches, packing, "cpu"))
        parallel.reduce_gradients(model)
        assert math.isclose(loss.item(), ref_loss, rel_tol=1e-12), (g, flags, loss.item(), ref_loss)
        ref_grads = dict(one.named_parameters())
        for name, p in model.named_parameters():
            # the last stage's tied copy
            twin = "embed.word.weight" if name == "output_weight" else name
            expected = parallel.shard(ref_grads[twin].grad, getattr(p, "tp_dim", None))
            torch.testing.assert_close(
                p.main_grad,
                expected,
                rtol=1e-9,
                atol=1e-12,
                msg=lambda m: f"{g} {flags} {name}: {m}",
            )


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_tp2_and_pp2_with_the_flags_match_one_process(tp, pp):
    """Every pipeline stage makes the documents and positions from its own copy of the micro-batch's tokens (the
    last the loss mask too): PP2's 1F1B schedule and TP2 compute one process's loss and gradients."""
    spawn(_layout_with_flags, 2, tp, pp)


# -----------------------------------------------------------------------------
# The keys


def test_flags_that_cannot_work_are_refused_by_name():
    def check(cfg):
        data_cfg, context = section(loader.DataConfig, cfg), section(loader.DataContext, cfg)
        loader.check(data_cfg, context, cfg.position_embedding_type)

    with pytest.raises(
        ValueError, match="reset_position_ids does nothing with position_embedding_type=alibi"
    ):
        check(
            arguments.load_config(
                ["config/tiny.py", "--position_embedding_type=alibi", "--reset_position_ids"]
            )
        )
    with pytest.raises(
        ValueError, match="end-of-document id 50256, which is not below vocab_size=512"
    ):
        check(arguments.load_config(["config/tiny.py", "--vocab_size=512", "--eod_mask_loss"]))


# -----------------------------------------------------------------------------
# End to end: train.py's step and evaluation


@pytest.mark.slow
def test_train_py_packs_documents_in_training_and_evaluation(tmp_path):
    """python train.py with the three flags on a corpus of short documents (GPT-2's end-of-document id): the
    training losses and the validation loss change -- the flags reach train_step and evaluate."""
    import numpy as np

    import data
    from helpers import log_fields, run_main

    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "short")
    data.write_indexed_dataset(
        prefix, [list(rng.integers(0, 100, rng.integers(3, 12))) + [data.EOD] for _ in range(400)]
    )
    base = [
        "--num_layers=2",
        "--hidden_size=32",
        "--num_attention_heads=4",
        "--seq_length=32",
        "--micro_batch_size=4",
        "--global_batch_size=8",
        "--train_iters=2",
        "--log_interval=1",
        "--eval_interval=2",
        "--eval_iters=1",
        "--split=80,20,0",
        f"--data_path={prefix}",
        "--device=cpu",
        "--save=none",
        "--save_interval=none",
        "--sample_tokens=0",
        "--lr_warmup_samples=0",
    ]
    valid = re.compile(r"validation loss at iteration 2 \| lm loss value: (\S+)")
    runs = {}
    for flags in ((), ("--reset_position_ids", "--reset_attention_mask", "--eod_mask_loss")):
        out = run_main(*base, *flags)
        runs[flags] = (
            log_fields(out)[1]["lm loss"],
            log_fields(out)[2]["lm loss"],
            valid.search(out).group(1),
        )
    plain, packed = runs.values()
    assert all(a != b for a, b in zip(plain, packed)), runs


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(position_embedding_type="rotary"),
        dict(position_embedding_type="alibi"),
        dict(position_embedding_type="rotary", num_query_groups=2),
    ],
    ids=["learned", "rotary", "alibi", "rotary-gqa"],
)
def test_the_flex_attention_block_mask_is_the_dense_masks_model(monkeypatch, variant):
    """On CUDA packed documents attend through FlexAttention's block mask (layers.DocumentBlockMask), with no T x T
    tensor; forced here on CPU, where flex_attention runs eagerly (forward only: its backward is CUDA's): the
    logits and the loss of a packed batch equal the dense-mask path's (fp32), for learned positions, rotary, ALiBi
    (its bias as a score modification) and GQA."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**BLOCK, **variant})).eval()
    x = packed_tokens()
    y = torch.randint(1, 50, x.shape, generator=torch.Generator().manual_seed(1))
    inputs = layers.packed_inputs(x, EOD, reset_position_ids=True, reset_attention_mask=True)
    results, seen, real = [], [], layers.DocumentBlockMask.attend
    monkeypatch.setattr(
        layers.DocumentBlockMask, "attend", lambda self, *a: seen.append(1) or real(self, *a)
    )
    for flex in (False, True):
        monkeypatch.setattr(layers, "flex_documents", lambda device, compiled, head_dim: flex)
        seen.clear()
        with torch.no_grad():
            results.append((model(x, **inputs), model(x, y, **inputs)))
        assert bool(seen) == flex  # the path asked for is the path taken
    (dense_logits, dense_loss), (flex_logits, flex_loss) = results
    torch.testing.assert_close(flex_logits, dense_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
def test_packed_documents_train_through_compiled_flex_attention_on_cuda(monkeypatch):
    """On a GPU with compiled blocks the block mask is the path taken, and the loss and every gradient equal the
    dense mask's (fp32; flex_attention's backward is CUDA's)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    # heads of 16: the narrowest inductor's flex_attention kernel takes (BLOCK's 8 take the dense mask)
    cfg = GPTConfig(
        **{**BLOCK, "hidden_size": 64, "position_embedding_type": "rotary", "num_query_groups": 2}
    )
    assert layers.flex_documents(device, True, cfg.hidden_size // cfg.num_attention_heads)
    model = GPT(cfg).to(device)
    model.compile_blocks()
    x = packed_tokens().to(device)
    y = torch.randint(1, 50, x.shape, generator=torch.Generator().manual_seed(1)).to(device)
    inputs = layers.packed_inputs(x, EOD, reset_position_ids=True, reset_attention_mask=True)
    results = []
    for flex in (False, True):
        monkeypatch.setattr(
            layers, "flex_documents", lambda device, compiled, head_dim: flex and compiled
        )
        model.zero_grad(set_to_none=True)
        loss = model(x, y, **inputs)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (dense, dense_grads), (flex, flex_grads) = results
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)


def test_heads_narrower_than_16_take_the_dense_mask_on_cuda():
    """inductor's flex_attention kernel refuses heads narrower than 16 (NotImplementedError at the first compile,
    seen on an H200): such a model keeps the dense mask on CUDA, compiled or not; the CPU never takes flex."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert layers.flex_documents(cuda, True, 16) and layers.flex_documents(cuda, True, 128)
    assert not layers.flex_documents(cuda, True, 8) and not layers.flex_documents(cuda, False, 64)
    assert not layers.flex_documents(cpu, True, 64)
