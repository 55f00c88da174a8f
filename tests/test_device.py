"""Correct on a device the tests never see: the CUDA path checked on CPU, by construction.

Every user trains on NVIDIA GPUs and no GPU runs these tests, so what would break there is made to break here:
- construction: the initial weights do not depend on the ambient device (torch.device(...) around the build),
  are drawn once, on the CPU, for this rank's slice, in chunks, with the bits of one draw of the whole tensor;
- one training step with every tensor on the `meta` device (see test_train_step_on_meta for why it stands in
  for CUDA), its host syncs counted: as many with 8 micro-batches as with 2;
- every collective and point-to-point call of 2-process gloo runs recorded: on the model's device, contiguous,
  in a dtype NCCL takes, no object collective inside the training loop;
- the RNG state saved and restored is the current CUDA device's only.
"""
import pytest
import torch

import model as model_module
import parallel
import train
from model import GPT, GPTConfig, draw_slice

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=1000,
           make_vocab_size_divisible_by=64, embed_layernorm=True)


def _weights(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -----------------------------------------------------------------------------
# Construction


@pytest.mark.parametrize("switches", [{}, dict(embed_init="xavier_uniform", position_embedding_init="sinusoidal")])
def test_init_ignores_the_ambient_device(switches):
    """init_weights under `with torch.device("meta")` gives the weights it gives without: its scratch tensors are
    made on the CPU, where its generator is. The same mechanism as CUDA's "Expected a 'cuda' device type for
    generator" when build_model ran the init inside `with torch.device("cuda")`."""
    cfg = GPTConfig(**CFG, **switches)
    here, there = GPT(cfg, seed=7), GPT(cfg, seed=0)
    with torch.device("meta"):
        there.init_weights(7)
    _assert_same(_weights(there), _weights(here))


def test_build_model_ignores_the_ambient_device():
    """train.build_model for the CPU called inside another ambient device builds the same model, on the CPU."""
    import arguments
    cfg = arguments.prepare(arguments.load_config(["--num_layers=2", "--hidden_size=32", "--num_attention_heads=4",
                                                   "--seq_length=16", "--vocab_size=1000", "--seed=5",
                                                   "--embed_layernorm"]))
    reference = _weights(train.build_model(cfg, torch.device("cpu")))
    with torch.device("meta"):
        built = train.build_model(cfg, torch.device("cpu"))
    assert all(p.device.type == "cpu" for p in built.parameters())
    _assert_same(_weights(built), reference)


def test_weights_drawn_once_per_parameter(monkeypatch):
    """build_model draws each random parameter once (GPT's seed), not once in GPT() and again afterwards."""
    import arguments
    cfg = arguments.prepare(arguments.load_config(["--num_layers=2", "--hidden_size=32", "--num_attention_heads=4",
                                                   "--seq_length=16", "--vocab_size=1000", "--seed=5"]))
    drawn = []
    original = model_module.draw_slice
    monkeypatch.setattr(model_module, "draw_slice", lambda out, *a, **k: drawn.append(out) or original(out, *a, **k))
    built = train.build_model(cfg, torch.device("cpu"))
    random = [p for n, p in built.named_parameters() if p.ndim == 2]
    assert len(drawn) == len(random) and {id(p) for p in drawn} == {id(p) for p in random}


@pytest.mark.parametrize("shape,rows", [((37, 13), 37), ((100, 24), 98), ((7, 1), 7), ((64, 17), 50)])
@pytest.mark.parametrize("kind", ["normal", "uniform"])
def test_chunked_draw_is_the_whole_draw(shape, rows, kind):
    """draw_slice's chunks give, bit for bit, every TP rank's slice of one draw of the whole tensor (its first
    `rows` rows drawn, the rest zeros), whatever the chunk size: odd widths, a tail shorter than 16 values."""
    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        if kind == "normal":
            return lambda t: t.normal_(0.0, 0.02, generator=gen)
        return lambda t: t.uniform_(-0.1, 0.1, generator=gen)

    full = torch.zeros(shape)
    draw(3)(full[:rows])
    for tp_dim in (None, 0, 1):
        for tp in (1, 2) if tp_dim is not None else (1,):
            if shape[tp_dim or 0] % tp:
                continue
            for rank in range(tp):
                expected = full if tp_dim is None else full.chunk(tp, tp_dim)[rank]
                for chunk in (1, 16, 40, 2**24):
                    out = torch.full_like(expected, float("nan"))
                    draw_slice(out, list(shape), tp_dim, rank, draw(3), rows=rows, chunk_numel=chunk)
                    assert torch.equal(out, expected), (tp_dim, tp, rank, chunk)


def test_no_rank_holds_a_full_tensor(monkeypatch):
    """A TP rank's init allocates on the host at most one chunk of a large tensor (BLOOM's embedding is 14 GiB),
    and its slice is bit-identical to the one cut from the whole tensor (TP=2 against one process)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided):
                Allocations.largest = max(Allocations.largest, out.numel())
            return out

    cfg = GPTConfig(**{**CFG, "vocab_size": 50257, "tensor_model_parallel_size": 2})
    whole = GPT(cfg, grid=parallel.Grid(1, 1, world_size=1, rank=0), seed=3)
    monkeypatch.setattr(model_module, "INIT_CHUNK_NUMEL", 4096)
    for rank in (0, 1):
        rank_model = GPT(cfg, grid=parallel.Grid(2, 1, world_size=2, rank=rank), seed=0)
        Allocations.largest = 0
        with Allocations():
            rank_model.init_weights(3)
        assert Allocations.largest <= 4096 + 2 * cfg.hidden_size  # a chunk is whole rows, multiples of 16 values
        for name, p in rank_model.named_parameters():
            tp_dim = getattr(p, "tp_dim", None)
            assert torch.equal(p, parallel.shard(dict(whole.named_parameters())[name], tp_dim,
                                                 parallel.Grid(2, 1, world_size=2, rank=rank))), name
