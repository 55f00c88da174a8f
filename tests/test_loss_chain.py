"""What the loss chain moves on a GPU, checked on the CPU, each against a reference: the compiled gradient of the
logits is one pointwise write over them (no scatter, no fp32 copy written back); the eager chain (the CPU's)
exponentiates each chunk once; the weight's gradient is summed over chunks in fp32 with no half-precision
(vocabulary x hidden) product; and with a GradBuffer the output layer's weight gradient goes into main_grad with no
.grad (fp16's too), counted once per backward, tied to the embedding or not."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode

import cross_entropy
import parallel

V_REAL, V, H = 1000, 1024, 16  # a padded vocabulary: 24 padding columns out of the softmax
aten = torch.ops.aten


def _chunk(dtype, tokens=12, seed=0):
    """A chunk's logits, its shift (the max) and per-token scale, targets with some on another rank (outside)."""
    g = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(tokens, V, generator=g, dtype=torch.float64)).to(dtype)
    local = torch.randint(0, V_REAL, (tokens,), generator=g)
    local[0], local[1] = 0, V_REAL - 1
    outside = torch.zeros(tokens, dtype=torch.bool)
    outside[2::5] = True
    wide = torch.promote_types(dtype, torch.float32)
    shift = logits[:, :V_REAL].amax(-1).to(wide)
    scale = torch.rand(tokens, generator=g, dtype=torch.float64).to(wide)
    return logits, shift, scale, local.masked_fill(outside, 0), outside


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_logits_grad_is_one_pointwise_write_over_the_logits(dtype):
    """The aten graph that torch.compile hands its backend (inductor's input) for logits_grad: (1) no scatter,
    index_put, slice/select_scatter (a functionalized setitem) or index_add; (2) every op whose result has the
    chunk's (tokens x vocabulary) shape is pointwise (torch.Tag.pointwise) or a dtype conversion (_to_copy), so
    inductor fuses them into one kernel and materializes no fp32 chunk, except (3) one aten.copy, the logits'
    mutation (input 0) to a value in their dtype, and that value the graph's one chunk-sized output: one write
    over them. The graph gives the
    eager numbers bit for bit, for a scalar one-hot (the forward's) and a per-token one (backward's)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    logits, shift, scale, local, outside = _chunk(dtype)
    for onehot in (1.0, torch.rand(len(shift), dtype=shift.dtype)):
        torch._dynamo.reset()
        graphs.clear()
        compiled = torch.compile(
            cross_entropy.logits_grad, backend=aot_autograd(fw_compiler=capture), fullgraph=True
        )
        ours = compiled(logits.clone(), shift, scale, onehot, local, outside, V_REAL)
        assert torch.equal(
            ours,
            cross_entropy.logits_grad(logits.clone(), shift, scale, onehot, local, outside, V_REAL),
        )
        (graph,) = graphs
        writes = []
        logits_input = next(n for n in graph.graph.nodes if n.op == "placeholder")
        for node in graph.graph.nodes:
            if node.op != "call_function":
                continue
            name = str(node.target)
            assert not any(
                bad in name for bad in ("scatter", "index_put", "index_add", "setitem")
            ), name
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.shape == logits.shape:
                if node.target == aten.copy.default:  # the mutation of the logits, functionalized
                    assert (
                        node.args[0] is logits_input and node.args[1].meta["val"].dtype == dtype
                    ), node.args
                    writes.append(node)
                else:
                    assert (
                        torch.Tag.pointwise in node.target.tags
                        or node.target == aten._to_copy.default
                    ), name
        assert len(writes) == 1, writes
        outputs = [
            a
            for a in next(iter(reversed(graph.graph.nodes))).args[0]
            if a.meta["val"].shape == logits.shape
        ]
        assert len({id(a) for a in outputs}) == 1 and outputs[0].meta["val"].dtype == dtype, outputs


class MatmulOutputs(TorchDispatchMode):
    """Records (op, shape, dtype) of every matmul's result run under it."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (aten.mm, aten.addmm, aten.matmul, aten.bmm, aten.baddbmm):
            self.outputs.append((str(func), tuple(out.shape), out.dtype))
        return out


def _inputs(dtype, tokens=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    weight = 0.5 * torch.randn(V, H, generator=g, dtype=torch.float64)
    target = torch.randint(0, V_REAL, (tokens,), generator=g)
    # one row of the weight's gradient summed over many tokens, in every chunk
    target[: tokens // 2] = 7
    return hidden.to(dtype), weight.to(dtype), target


class ChunkSized(TorchDispatchMode):
    """Records the op of every result of one of `shapes` (a chunk's logits: tokens x vocabulary, padded or not) run
    under it, and whether it made a new tensor (not a view, not written in place)."""

    def __init__(self, *shapes):
        super().__init__()
        self.shapes, self.ops, self.made = shapes, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) in self.shapes:
            self.ops.append(str(func.overloadpacket))
            if not (func.is_view or func._schema.is_mutable):
                self.made.append(str(func))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_chain_exponentiates_each_chunk_once(dtype, monkeypatch):
    """The eager chain (the CPU's) of the mean's forward: one exp over each chunk's logits, shared by the sum of
    exp and the gradient (computing it again, with a chunk-sized `logits - max`, cost the CPU 7% of a 6 x 384
    step: issue 39), and no chunk-sized tensor made but one buffer that every chunk's logits are written into
    (bf16: and each chunk's fp32 exponentials), which the next forward writes into again (made afresh, its
    pages were faulted in again on every forward: 19k at 6 x 384). Same numbers as the fp64 reference."""
    # chunks of H = 16 tokens: 3 of them
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 1)
    monkeypatch.setattr(cross_entropy, "CPU_LOGITS", [])  # none kept from an earlier test
    hidden, weight, target = _inputs(dtype)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    # bf16: each chunk's fp32 exps
    copies = ["aten._to_copy.default"] * 3 if dtype != torch.float32 else []
    # one buffer for every chunk, and for the next forward
    for made in (
        ["aten.new_empty.default"],
        [],
    ):
        with ChunkSized((H, V), (H, V_REAL)) as recorded:
            loss, _ = cross_entropy.linear_cross_entropy(h, w, target, V_REAL, 1e-2, "mean")
        exps = ("aten.exp", "aten.exp_", "aten.softmax", "aten._softmax")
        assert sum(recorded.ops.count(op) for op in exps) == 3, recorded.ops
        assert recorded.made == made + copies, recorded.made
    loss.backward()
    exact = _reference(hidden, weight, target)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert _error(w.grad, exact[1]) < tolerance and _error(h.grad, exact[0]) < tolerance


class ChunkOps(TorchDispatchMode):
    """Records the name of every op (not a view) that reads or makes a tensor as large as a chunk's logits."""

    def __init__(self, elements):
        super().__init__()
        self.elements, self.ops = elements, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        large = [
            t for t in (*args, out) if isinstance(t, torch.Tensor) and t.numel() >= self.elements
        ]
        if large and not func.is_view:
            self.ops.append(str(func.overloadpacket).removeprefix("aten."))
        return out


def test_eager_chain_takes_the_softmax_from_torchs_kernel_a_row_at_a_time(monkeypatch):
    """Between a chunk's logits (mm) and its gradient's products (mm, addmm): the max and the target's logit, torch's
    softmax over the chunk written over it (a row at a time through the cache), the max of that (1 / the sum of
    exp), and the one-hot subtracted. The subtract, exp, sum and scale it replaces each went through the chunk in
    memory: 1.7x the time at 2048 x 50304 on 2 cores, 2-6% of a 6 x 384 model's CPU step (docs/speed.md)."""
    # the logits buffer made here (new_empty), not kept
    monkeypatch.setattr(cross_entropy, "CPU_LOGITS", [])
    hidden, weight, target = _inputs(torch.float32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with ChunkOps(hidden.shape[0] * V_REAL) as recorded:  # one chunk of 48 tokens
        cross_entropy.linear_cross_entropy(h, w, target, V_REAL, 0.0, "mean")
    assert recorded.ops == [
        "new_empty",
        "mm",
        "amax",
        "gather",
        "softmax",
        "amax",
        "scatter_add_",
        "mm",
        "mm",
    ], " ".join(recorded.ops)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp32_weight_gradient_sum_starts_from_the_first_product_not_zeros(reduction, monkeypatch):
    """fp32: the first chunk's product is written into the weight's gradient sum instead of added to zeros: no
    weight-sized zero fill (a 77 MB pass a micro-batch at 384 x 50304 on the CPU), the same bits as before (the
    reference: the sum started from zeros, every chunk added)."""
    # chunks of H = 16 tokens: 3 of them
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 1)
    hidden, weight, target = _inputs(torch.float32)

    def grads():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with WeightSized() as recorded:
            loss, _ = cross_entropy.linear_cross_entropy(h, w, target, V_REAL, 1e-2, reduction)
            loss.mean().backward()
        return recorded.ops, w.grad

    ops, ours = grads()
    assert not {"aten.zeros", "aten.new_zeros", "aten.zero_", "aten.fill_"} & set(ops), ops
    assert ops.count("aten.mm") == 1 and ops.count("aten.addmm") == 2, ops
    chunk_grads = cross_entropy.chunk_grads
    monkeypatch.setattr(
        cross_entropy, "weight_grad_sum", lambda w, dtype, _: w.new_zeros(w.shape, dtype=dtype)
    )
    monkeypatch.setattr(cross_entropy, "chunk_grads", lambda *args, first: chunk_grads(*args))
    ops, reference = grads()
    assert "aten.new_zeros" in ops and torch.equal(ours, reference)


def test_micro_batch_at_gpt2_vocabulary_is_one_chunk_on_the_cpu_too():
    """2048 tokens (issue 39's CPU shape: 8 x 256) at GPT-2's padded vocabulary, 384 wide: one chunk on the CPU as
    on a GPU, one (vocabulary x hidden) product and no fp32 sum over chunks. CPU chunks of 16 MiB (6 of 384
    tokens) cost that model 2-6% of its tokens/s in the sum's passes over a weight-sized buffer (docs/speed.md).
    Meta tensors: the shapes, not the arithmetic."""
    vocab, width, tokens = 50304, 384, 2048
    hidden = torch.empty(tokens, width, device="meta", requires_grad=True)
    weight = torch.empty(vocab, width, device="meta", requires_grad=True)
    target = torch.zeros(tokens, dtype=torch.long, device="meta")
    with WeightSized((vocab, width)) as recorded:
        loss, _ = cross_entropy.linear_cross_entropy(hidden, weight, target, 50257, 0.0, "mean")
        loss.backward()
    products = [op for op in recorded.ops if op in ("aten.mm", "aten.addmm")]
    assert products == ["aten.mm"], products


class WeightSized(TorchDispatchMode):
    """Records the op of every result of the weight's shape (V x H unless told) run under it."""

    def __init__(self, shape=(V, H)):
        super().__init__()
        self.ops, self.shape = [], shape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            self.ops.append(str(func.overloadpacket))
        return out


def _reference(hidden, weight, target, z_loss=1e-2):
    """F.cross_entropy on the real columns in fp64: the gradients of the mean plus the z-loss."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = F.linear(h, w)[:, :V_REAL]
    (F.cross_entropy(logits, target) + z_loss * logits.logsumexp(-1).square().mean()).backward()
    return h.grad, w.grad


def _error(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16_weight_gradient_sums_chunks_with_no_bf16_vocab_by_hidden_product(
    reduction, monkeypatch
):
    # 48 tokens in chunks of H = 16: three chunks' products with the hidden states summed in fp32
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 1)
    hidden, weight, target = _inputs(torch.bfloat16)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with MatmulOutputs() as recorded:
        loss, _ = cross_entropy.linear_cross_entropy(h, w, target, V_REAL, 1e-2, reduction)
        loss.mean().backward()
    weight_sized = [o for o in recorded.outputs if o[1] == (V, H)]
    assert len(weight_sized) == 3 and all(o[2] == torch.float32 for o in weight_sized), (
        recorded.outputs
    )
    exact = _reference(hidden, weight, target)
    assert w.grad.dtype == torch.bfloat16
    assert _error(w.grad, exact[1]) < 1e-2 and _error(h.grad, exact[0]) < 1e-2


def _grad_buffer(weight, dtype):
    w = torch.nn.Parameter(weight.clone())
    return w, parallel.GradBuffer([w], dtype)


@pytest.mark.parametrize(
    "dtype,buffer_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
    ],
)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_output_weight_gradient_goes_into_main_grad_with_no_grad(
    dtype, buffer_dtype, reduction, monkeypatch
):
    """Two micro-batches' backwards with a GradBuffer: autograd never accumulates a .grad of the weight (its
    post-accumulate hook never runs, and no tensor of the weight's shape in its half dtype is made), main_grad
    holds the sum of the two gradients (fp32 weights: the .grad path's to fp32 rounding; half: as close to fp64
    as the .grad path at least)."""
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 1)
    batches = [_inputs(dtype, seed=s) for s in (0, 1)]
    weight = batches[0][1]
    upstream = 2.0**10 if dtype == torch.float16 else 1.0  # a loss scale
    w, buffer = _grad_buffer(weight, buffer_dtype)
    fired = []
    w.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    made = []

    class WeightSized(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # a new tensor
            if (
                not (func.is_view or func._schema.is_mutable)
                and isinstance(out, torch.Tensor)
                and out.shape == w.shape
                and out.dtype == dtype != torch.float32
            ):
                made.append(str(func))
            return out

    plain = weight.clone().requires_grad_()  # the .grad path: no GradBuffer
    for hidden, _, target in batches:
        for p in (w, plain):
            with WeightSized() if p is w else contextlib.nullcontext():
                loss, _ = cross_entropy.linear_cross_entropy(
                    hidden.clone().requires_grad_(), p, target, V_REAL, 1e-2, reduction
                )
                (upstream * loss.mean()).backward()
    assert not fired and w.grad is None and not made, (len(fired), made)
    exact = [sum(pair) for pair in zip(*(_reference(h, weight, t) for h, _, t in batches))]
    if dtype == torch.float32:
        # fp32 rounding: main_grad + g * scale in one op
        torch.testing.assert_close(w.main_grad, plain.grad)
    else:
        assert _error(w.main_grad / upstream, exact[1]) <= _error(
            plain.grad.double() / upstream, exact[1]
        )


@pytest.mark.parametrize("tied", [False, True])
def test_main_grad_bucket_launches_once_the_weight_gradient_is_complete(tied, monkeypatch):
    """A data-parallel GradBuffer (its collective recorded instead of run) over two micro-batches: the weight's
    bucket is launched once, in the last backward, holding the whole gradient: the loss's part alone when the
    weight is the output layer's own, and only after the embedding's part when the weight is also the word
    embedding (the loss's add comes first in backward, the embedding's .grad last)."""
    monkeypatch.setattr(cross_entropy, "CROSS_ENTROPY_CHUNK", 1)
    batches = [_inputs(torch.float32, seed=s) for s in (0, 1)]
    w, buffer = _grad_buffer(batches[0][1], torch.float32)
    buffer.group, buffer.size = "dp", 1
    launched = []
    monkeypatch.setattr(
        parallel.dist, "all_reduce", lambda flat, **kw: launched.append(flat.clone()) or kw
    )
    plain = batches[0][1].clone().requires_grad_()
    buffer.start(2)
    for i, (hidden, _, target) in enumerate(batches):
        ids = target % V_REAL
        for p in (w, plain):
            x = hidden + F.embedding(ids, p) if tied else hidden.clone().requires_grad_()
            loss, _ = cross_entropy.linear_cross_entropy(x, p, target, V_REAL, 1e-2, "mean")
            loss.backward()
        assert len(launched) == i  # nothing before the last micro-batch's gradient is whole
    torch.testing.assert_close(launched[0].view_as(w), plain.grad, atol=1e-6, rtol=1e-6)
    assert torch.equal(launched[0].view_as(w), w.main_grad)
