"""The output layer and the vocab-parallel cross-entropy in one, without the (tokens x vocabulary) logits.

The logits are a GPT's largest activation (gpt2_125m's micro-batch: 16k tokens x 50k columns, 3.3 GB in fp32)
and the output layer a third of its FLOPs. linear_cross_entropy takes a chunk of tokens at a time: their logits
(in the compute dtype, as F.linear), taken to fp32, give the log-sum-exp and the target's logit over the whole
vocabulary (with TP: each rank's max, then sums, all-reduced), and -- when a gradient is wanted -- at once
d(loss)/d(logits) = softmax - onehot, turned into the chunk's share of both gradients (Liger-Kernel's fused
linear cross-entropy). Three matmuls per chunk, as the plain output layer; the chunk is freed before the next.

Same numbers as parallel.vocab_parallel_cross_entropy(F.linear(hidden, weight), ...) to fp32 rounding: padding
columns (ids >= vocab_size) are left out of the softmax, z_loss adds z_loss * log(Z)^2 to the gradient (not to
the value), and log Z comes back alongside, without a gradient, for the log.
"""

import functools
import types

import torch
import torch.distributed as dist

import parallel

# Elements of the (tokens x vocabulary) fp32 logits held at once, a chunk of tokens' rows: 512 MiB. Each chunk
# adds its share to the weight's fp32 gradient, a pass over a weight-sized buffer (8-12 bytes an element) against
# the chunk's three matmuls (6 x tokens FLOPs an element), so a chunk needs enough tokens for that pass to cost
# little: on a GPU (~250 FLOPs a byte) a few thousand (gpt2_125m's micro-batch: 7 chunks of 2668 tokens, about
# 1 GiB in all against 4.6 GiB for the logits), on the CPU as many. The CPU once took 16 MiB chunks, under glibc's
# largest mmap threshold, whose pages are reused rather than faulted in afresh; its logits buffer is now kept from
# one forward to the next (logits_buffer), and the small chunks' sums cost a 6 x 384 model 2-6% of its tokens/s
# (6 chunks of 384 tokens against one; docs/speed.md).
CROSS_ENTROPY_CHUNK = 2**27


def linear_cross_entropy(hidden, weight, target, vocab_size=None, z_loss=0.0, reduction="none"):
    """(loss, per-token log Z) of the logits hidden @ weight^T, weight this rank's vocabulary slice of the output
    layer, at most CROSS_ENTROPY_CHUNK fp32 logits at a time. vocab_size=None: every column is a token.

    reduction "mean" (the model's): the mean loss, whose gradient the forward computes for an upstream gradient
    of 1; backward only scales what it holds (the hidden states' gradient in their dtype, the weight's in the
    weight's, fp32 for fp16 whose range could not hold it before the loss scale). No gradient wanted (no_grad,
    evaluation): the loss alone. reduction "none": the per-token loss, whose upstream gradient may differ per
    token, so backward computes each chunk's logits again (a fourth matmul, which "mean" saves)."""
    if reduction not in ("none", "mean"):
        raise ValueError(f"reduction must be 'none' or 'mean', not {reduction!r}")
    vocab_local = weight.shape[0]
    if vocab_size is None:
        vocab_size = vocab_local * parallel.grid.tp_size
    # at least hidden_size tokens: a chunk's logits no smaller than the fp32 sum of the weight's gradient over
    # chunks, which would otherwise cost more memory than the chunking saves (tr11_176b's micro-batch of 4096
    # tokens at 14336 wide: one chunk, and no fp32 sum; 3.6 GB at TP4)
    tokens = max(CROSS_ENTROPY_CHUNK // vocab_local, hidden.shape[-1])
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    add = main_grad_adder(weight) if grad and hidden.requires_grad else None
    # autograd carries no gradient of the weight: backward adds it into main_grad itself
    if add is not None:
        weight = weight.detach()
    return LinearCrossEntropy.apply(
        hidden, weight, target, vocab_size, z_loss, tokens, reduction, grad, add
    )


def main_grad_adder(weight):
    """(gradient, scale or None) -> None adding gradient * scale into the weight's fp32 main_grad (a GradBuffer's, which
    the weight's post-accumulate hook would otherwise fill from a .grad in the weight's dtype: a weight-sized
    tensor made, rounded to the half dtype, read and freed each micro-batch); None where there is none
    (DeepSpeed, no buffer, a frozen weight)."""
    buffer = getattr(weight, "main_grad_buffer", None)
    if buffer is None or not weight.requires_grad or not weight.is_leaf:
        return None
    return functools.partial(buffer.add, weight)


class LinearCrossEntropy(torch.autograd.Function):
    """linear_cross_entropy's autograd: the gradients of the mean computed in forward, handed to autograd by
    backward alone, so a forward run again (activation checkpointing, a replay) accumulates nothing twice."""

    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_size, z_loss, tokens, reduction, grad, add):
        grid = parallel.grid
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)
        vocab_local = weight.shape[0]
        # my columns that are tokens
        real = min(max(vocab_size - grid.tp_rank * vocab_local, 0), vocab_local)
        h = hidden.reshape(-1, hidden.shape[-1])
        local = target.reshape(-1) - grid.tp_rank * vocab_local
        outside = (local < 0) | (local >= real)
        local = local.masked_fill(outside, 0)
        log_z, loss = h.new_empty(local.shape, dtype=dtype), h.new_empty(local.shape, dtype=dtype)
        fused = grad and reduction == "mean"
        if fused:  # the weight's gradient summed over chunks in fp32; in one chunk, one product (fp16: fp32)
            grad_hidden = torch.empty_like(h)
            one = h.shape[0] <= tokens and weight.dtype != torch.float16
            grad_weight = weight_grad_sum(weight, weight.dtype if one else dtype, h.dtype)
        # written by every chunk in turn
        buffer = logits_buffer(h, min(tokens, h.shape[0]), vocab_local)
        for i in range(0, h.shape[0], tokens):
            c = slice(i, i + tokens)
            logits, probs, log_z[c], loss[c] = chunk_softmax(
                h[c], weight, local[c], outside[c], real, buffer
            )
            if fused:  # softmax * (1 + 2 z_loss log Z) - onehot: the z-loss's gradient rides along (lesson 20)
                scale = 1.0 + 2.0 * z_loss * log_z[c] if z_loss else None
                g = chain.logit_grad(
                    logits, log_z[c], scale, 1.0, local[c], outside[c], real, probs
                )
                grad_hidden[c] = chunk_grads(g, h[c], weight, grad_weight, first=i == 0)
            del logits, probs
        log_z = log_z.view(target.shape)
        ctx.mark_non_differentiable(log_z)
        ctx.shape, ctx.dtype, ctx.reduction, ctx.real, ctx.z_loss, ctx.tokens, ctx.add = (
            hidden.shape,
            weight.dtype,
            reduction,
            real,
            z_loss,
            tokens,
            add,
        )
        if fused:  # held until backward in the weight's dtype (fp16: fp32), or as summed when added to main_grad
            kept = (
                grad_weight.dtype
                if add
                else torch.float32
                if weight.dtype == torch.float16
                else weight.dtype
            )
            ctx.save_for_backward(grad_hidden, grad_weight.to(kept))
        elif grad:
            ctx.save_for_backward(hidden, weight, local, outside, log_z)
        return (loss.mean() if reduction == "mean" else loss.view(target.shape)), log_z

    @staticmethod
    def backward(ctx, grad, _grad_log_z):
        if ctx.reduction == "mean":  # the forward's gradients, of the mean over this many tokens
            grad_hidden, grad_weight = ctx.saved_tensors
            grad = grad / grad_hidden.shape[0]
            return (
                grad_hidden.mul_(grad).view(ctx.shape),
                weight_grad(ctx, grad_weight, grad),
                *[None] * 7,
            )
        hidden, weight, local, outside, log_z = ctx.saved_tensors
        h, log_z = hidden.reshape(-1, hidden.shape[-1]), log_z.reshape(-1)
        grad = grad.reshape(-1).to(log_z.dtype)
        grad_hidden = torch.empty_like(h)
        grad_weight = weight_grad_sum(weight, log_z.dtype, h.dtype)
        # the forward's, on the CPU
        buffer = logits_buffer(h, min(ctx.tokens, h.shape[0]), weight.shape[0])
        for i in range(0, h.shape[0], ctx.tokens):
            c = slice(i, i + ctx.tokens)
            scale = grad[c] * (1.0 + 2.0 * ctx.z_loss * log_z[c]) if ctx.z_loss else grad[c]
            logits = torch.mm(h[c], weight.t(), out=buffer[: len(h[c])])
            g = chain.logit_grad(logits, log_z[c], scale, grad[c], local[c], outside[c], ctx.real)
            grad_hidden[c] = chunk_grads(g, h[c], weight, grad_weight, first=i == 0)
        return grad_hidden.view(ctx.shape), weight_grad(ctx, grad_weight), *[None] * 7


def weight_grad(ctx, grad_weight, scale=None):
    """The weight's gradient grad_weight * scale for autograd, in the weight's dtype; or None, added into the
    weight's main_grad in one pass (its dtype, fp32 for bf16: no rounding to bf16 on the way)."""
    if ctx.add is not None:
        ctx.add(grad_weight, scale)
        return None
    return (grad_weight if scale is None else grad_weight.mul_(scale)).to(ctx.dtype)


def chunk_softmax(hidden, weight, local, outside, real, buffer):
    """A chunk of tokens' logits over all of this rank's rows of the output layer (a multiple of 128 when the
    vocabulary is padded, so that cuBLAS keeps its aligned kernels on every TP rank), in the compute dtype; the
    first `real` columns are tokens, the rest never enter the softmax, written into buffer's first rows. Their max
    and sum of exp on this rank, then over TP the max (all-reduced) and the sums of exp (taken to that max) and of
    the target's logit (one all-reduce for both). Returns (logits, the softmax in fp32 at least or None (eager:
    logits_sum_exp; compiled: the gradient's kernel computes it), log Z, loss = log Z - target)."""
    grid = parallel.grid
    logits = torch.mm(hidden, weight.t(), out=buffer[: len(hidden)])
    top, target_logit = chain.max(logits, local, outside, real)
    # to this rank's max; probs: over this rank's columns
    sum_exp, probs = chain.sum_exp(logits, top, real)
    if grid.tp_size > 1:
        mine = top.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=grid.tp_group)
        # to the vocabulary's max (a rank of padding only: 0 x 0)
        sum_exp = sum_exp * (mine - top).exp()
    sums = torch.stack((sum_exp, target_logit))
    if grid.tp_size > 1:
        dist.all_reduce(sums, group=grid.tp_group)
        if probs is not None:  # this rank's softmax to the vocabulary's
            probs.mul_((sum_exp / sums[0]).unsqueeze(-1))
    log_z = top + sums[0].log()
    return logits, probs, log_z, log_z - sums[1]


CPU_LOGITS = []  # the CPU's logits buffer, kept from one forward to the next (logits_buffer)


def logits_buffer(h, rows, columns):
    """The buffer every chunk's logits are written into, in h's dtype: one per forward, not one per chunk. On the
    CPU the last one is kept for the next forward with the same shape: made afresh, a buffer past glibc's largest
    mmap threshold (32 MiB) gets fresh pages, which the kernel faults in and zeroes each time (8 x 256 tokens at
    GPT-2's vocabulary: 412 MB, 100k faults a forward). Nothing of it outlives the call that fills it (a forward,
    or the backward of per-token losses, which computes the logits again): the gradients and the losses are
    tensors of their own. On a GPU the caching allocator keeps the memory itself."""
    if h.device.type != "cpu":
        return h.new_empty(rows, columns)
    if not CPU_LOGITS or CPU_LOGITS[0].shape != (rows, columns) or CPU_LOGITS[0].dtype != h.dtype:
        CPU_LOGITS[:] = [h.new_empty(rows, columns)]
    return CPU_LOGITS[0]


def weight_grad_sum(weight, dtype, compute_dtype):
    """The buffer the chunks' weight gradients are summed in: uninitialised where the first chunk's product is
    written into it (chunk_grads' first), zeros where it is added (a half-precision product summed in fp32). A
    weight-sized pass of zeros fewer per micro-batch (the CPU's fp32 path: 77 MB at 384 x 50304)."""
    if dtype == compute_dtype:
        return weight.new_empty(weight.shape, dtype=dtype)
    return weight.new_zeros(weight.shape, dtype=dtype)


def chunk_grads(g, hidden, weight, grad_weight, first=False):
    """g = d(loss)/d(logits) in the compute dtype: adds its product with the hidden states to grad_weight (fp32
    where it sums several chunks; first: writes it, over weight_grad_sum's uninitialised buffer, the same bits as
    adding it to zeros) and returns its product with the weight, the chunk's rows of the hidden states' gradient
    (with TP, this rank's share: parallel.copy_to_tp's backward sums them)."""
    if grad_weight.dtype == g.dtype and first:
        torch.mm(g.t(), hidden, out=grad_weight)
    elif grad_weight.dtype == g.dtype:
        # as addmm_, which FlopCounterMode misses
        torch.addmm(grad_weight, g.t(), hidden, out=grad_weight)
    else:  # bf16/fp16 products summed in fp32 (by the matmul on CUDA, from exact fp32 copies on the CPU)
        parallel.add_product(grad_weight, g.t(), hidden)
    return g @ weight


# -- the elementwise chain: between the matmuls and the all-reduces, compiled into a few fused kernels where the
# run compiles (compile_chain). Eager, they hold one fp32 copy of a chunk's logits at a time.


def logits_max(logits, local, outside, real):
    """(max over the real columns, the target's logit or 0 where it is another rank's) in fp32 at least."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if not real:  # a slice of padding only (possible with a large TP): the other ranks have the max and the target
        return logits.new_full(logits.shape[:-1], float("-inf"), dtype=dtype), logits.new_zeros(
            logits.shape[:-1], dtype=dtype
        )
    # exact: the max of fp16/bf16 numbers is one of them
    top = logits[:, :real].amax(dim=-1).to(dtype)
    return top, logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).to(dtype).masked_fill(
        outside, 0.0
    )


def logits_sum_exp(logits, top, real):
    """(the sum of exp(logits - top) over the real columns in fp32 at least, top their max; the softmax over them
    or None).

    Eager, the softmax is kept for logits_grad, which would otherwise exponentiate the logits again: torch's
    softmax kernel, written over fp32 logits (an fp32 copy of half ones: the one the sum needs anyway), the
    padding columns -inf first (their softmax 0, the gradient's value there). It takes a row at a time through
    the cache: one read and one write of the chunk where a max, subtract, exp and sum each went through memory
    (at 2048 x 50304 on 2 cores, best of 5, 57-59 ms against 100-102 for the chain; a second pass of subtract and
    exp, with a chunk-sized temporary, was issue 39's CPU regression). The sum is 1 / the softmax's max: exp(0) /
    sum, to rounding.
    Compiled, None and the logits untouched: the sum is one fused reduction that writes no chunk, and
    logits_grad's one pointwise kernel computes the softmax from the logits, cheaper on a GPU than an fp32 chunk
    written and read."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if torch.compiler.is_compiling():
        x = logits[:, :real]
        return (
            x - top.unsqueeze(-1) if x.dtype == dtype else x.to(dtype) - top.unsqueeze(-1)
        ).exp().sum(-1), None
    if not real:  # padding only: nothing of the softmax on this rank
        return logits.new_zeros(logits.shape[:-1], dtype=dtype), None
    logits[:, real:] = float("-inf")
    x = logits if logits.dtype == dtype else logits.to(dtype)
    probs = torch.softmax(x, -1, out=x)
    return probs[:, :real].amax(dim=-1).reciprocal(), probs


def logits_grad(logits, shift, scale, onehot, local, outside, real, probs=None):
    """d(loss)/d(logits) = exp(logits - shift) * scale - onehot(target) * onehot (shift log Z: the softmax; scale
    None: 1), zero in the padding columns, written over the logits (the compute dtype) and returned: no second
    chunk-sized buffer. probs: exp(logits - shift), all of this rank's columns, where logits_sum_exp kept them
    (eager), overwritten here.

    Compiled (compile_chain), one pointwise expression, which inductor makes one kernel reading the logits and
    writing the gradient over them once (4 bytes an element in bf16): the one-hot a comparison of each column's
    index with the target, not a scatter, which would need the chunk in fp32 in memory to scatter into. Eager,
    that expression would make a chunk-sized temporary of each step (13x the time in fp32, 5x in bf16, hundreds of
    MB on 1024 tokens; docs/speed.md): in place instead, in one fp32 copy (none in fp32), the one-hot scattered."""
    if torch.compiler.is_compiling():
        return logits.copy_(pointwise_grad(logits, shift, scale, onehot, local, outside, real))
    dtype = torch.promote_types(logits.dtype, torch.float32)
    x = (
        logits[:, :real].to(dtype).sub_(shift.unsqueeze(-1)).exp_()
        if probs is None
        else probs[:, :real]
    )
    if scale is not None:
        x.mul_(scale.unsqueeze(-1))
    if real:
        x.scatter_add_(-1, local.unsqueeze(-1), (~outside * -onehot).to(dtype).unsqueeze(-1))
    if x.dtype != logits.dtype:
        logits[:, :real] = x
    logits[:, real:] = 0.0
    return logits


def pointwise_grad(logits, shift, scale, onehot, local, outside, real):
    """logits_grad's value as one pointwise expression of the logits and per-row vectors, in the logits' dtype
    (the same numbers as the eager path: each element the same operations in the same order)."""
    column = torch.arange(logits.shape[-1], device=logits.device)
    # -1: no column (the target is another rank's)
    target = local.masked_fill(outside, -1).unsqueeze(-1)
    onehot = onehot.unsqueeze(-1) if torch.is_tensor(onehot) else onehot
    x = (logits.to(torch.promote_types(logits.dtype, torch.float32)) - shift.unsqueeze(-1)).exp()
    x = x if scale is None else x * scale.unsqueeze(-1)
    x = torch.where(column == target, x - onehot, x)
    return torch.where(column < real, x, 0.0).to(logits.dtype)


chain = types.SimpleNamespace(max=logits_max, sum_exp=logits_sum_exp, logit_grad=logits_grad)


def compile_chain(on=True, **kwargs):
    """torch.compile the elementwise chain (on where the run compiles, train.py): each function a fused kernel
    reading the compute-dtype logits, about 4x their bytes in all in bf16 (docs/speed.md).
    kwargs go to torch.compile (a backend). on=False puts the eager functions back."""
    for name, fn in (("max", logits_max), ("sum_exp", logits_sum_exp), ("logit_grad", logits_grad)):
        setattr(chain, name, torch.compile(fn, **kwargs) if on else fn)
