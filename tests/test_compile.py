"""compile=True: each block is one graph (no graph break), with dropout and activation checkpointing, and the
compiled model trains bit for bit as the eager one (the aot_eager backend: dynamo and AOT autograd without
inductor's kernels, so that the only difference a break or a replayed mask could make shows)."""

import glob
import os

import pytest
import torch
from torch._dynamo.utils import counters

import arguments
import parallel
import rng
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "config", "*.py")))
BLOCK_KEYS = (
    "position_embedding_type",
    "apply_query_key_layer_scaling",
    "stable_attention",
    "qk_layernorm",
    "normformer",
    "activation",
)


def tiny(name=None, **kw):
    """A tiny model with config `name`'s block settings, dropout on everywhere."""
    settings = {}
    if name is not None:
        cfg = arguments.derive(
            arguments.load_config([os.path.join(ROOT, "config", f"{name}.py")]), world_size=1
        )
        settings = {key: getattr(cfg, key) for key in BLOCK_KEYS}
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=300,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        embed_dropout=0.1,
    )
    return GPTConfig(**{**base, **settings, **kw})


@pytest.mark.parametrize("name", CONFIGS)
def test_a_block_is_one_graph(name):
    rng.seed(1)  # the model-parallel stream exists, as in training
    gpt = GPT(tiny(name)).train()
    x = torch.randn(2, 16, 32, requires_grad=True)
    explained = torch._dynamo.explain(gpt.blocks["0"])(x, *gpt.positions(x))
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    assert explained.graph_count == 1


def _train(compiled, steps=3):
    torch.manual_seed(5)
    rng.seed(5)
    gpt = GPT(tiny("tr8b_104b", checkpoint_activations=True, z_loss=1e-4)).train()
    if compiled:
        gpt.compile_blocks(backend="aot_eager")
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 300, (2, 16), generator=g)
        loss = gpt(ids, targets=ids.roll(-1, dims=1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), gpt.state_dict()


def test_compiled_training_equals_eager_bit_for_bit():
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    eager, eager_state = _train(False)
    assert counters["stats"]["unique_graphs"] == 0
    compiled, compiled_state = _train(True)
    # the blocks were traced (a compile_blocks that compiled nothing would compare eager with eager)
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    assert torch.equal(compiled, eager), (compiled, eager)
    for key in eager_state:
        assert torch.equal(compiled_state[key], eager_state[key]), key
    assert len(set(eager.tolist())) == len(eager)  # it trained: three different losses


def test_compile_keeps_parameter_names():
    gpt = GPT(tiny())
    names = list(gpt.state_dict())
    assert list(gpt.compile_blocks(backend="eager").state_dict()) == names


@pytest.mark.cuda
def test_compiled_block_on_cuda_matches_eager():
    """inductor's kernels on a GPU, bf16: close to eager (fused kernels round differently), no graph break."""
    cfg = tiny(
        "tr3_1b3",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        embed_dropout=0.0,
        hidden_size=256,
        seq_length=256,
    )
    gpt = GPT(cfg).to("cuda", torch.bfloat16).train()
    ids = torch.randint(0, 300, (2, 256), device="cuda")
    eager = gpt(ids, targets=ids)
    torch._dynamo.reset()
    # explained before compile_blocks: explain() of a module already compiled reports no graph at all (-1 breaks,
    # torch 2.11 on an H200), which says nothing of the graph compile_blocks traces
    explained = torch._dynamo.explain(gpt.blocks["0"])(
        torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16)
    )
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    gpt.compile_blocks()
    compiled = gpt(ids, targets=ids)
    compiled.backward()
    torch.testing.assert_close(compiled.float(), eager.float(), atol=2e-2, rtol=2e-2)


def test_a_tensor_parallel_block_compiles_around_its_forked_core():
    # TP rank 0 of 2, built in this process (a grid on paper): its attention dropout draws from the model-parallel
    # stream (rng.fork), whose generator swap dynamo cannot trace, so compile_blocks compiles the two sides of
    # the attention core, each one graph, and leaves the core (and the swap) outside
    def model():
        torch.manual_seed(5)
        rng.seed(5)
        cfg = tiny(tensor_model_parallel_size=2, checkpoint_activations=True)
        return GPT(cfg, grid=parallel.Grid(2, 1, world_size=2, rank=0)).train()

    gpt = model()
    block, x = gpt.blocks["0"], torch.randn(2, 16, 32, requires_grad=True)
    bias, rotary = gpt.positions(x)
    # whole, the fork breaks it
    assert torch._dynamo.explain(block)(x, bias, rotary).graph_break_count > 0
    q, _, _ = block.before_attention(x, rotary)
    for side, args in ((block.before_attention, (x, rotary)), (block.after_attention, (x, q))):
        explained = torch._dynamo.explain(side)(*args)
        assert explained.graph_break_count == 0, [
            str(b.reason)[:200] for b in explained.break_reasons
        ]
        assert explained.graph_count == 1
    # and compiled, it trains as eager: the same masks from both streams, checkpointing's replay included
    torch._dynamo.reset()
    # rank 0's vocabulary
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        gpt = model()
        if compiled:
            gpt.compile_blocks(backend="aot_eager")
        counters.clear()
        loss = gpt(ids, targets=ids.roll(-1, dims=1))
        loss.backward()
        results.append((loss.detach(), [p.grad for p in gpt.parameters()]))
    assert not counters["graph_break"], dict(counters["graph_break"])  # compile_blocks: none
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
