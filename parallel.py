"""Hand-written 3D parallelism: tensor (TP), pipeline (PP) and data (DP) parallel.

Ranks are laid out as in Megatron: TP fastest, then DP, then PP, so that the chatty TP group sits inside one
node.  With a single process every piece below degenerates to the plain op (no communication), so model.py
uses these layers unconditionally and reads like a normal GPT.

Tensor parallelism follows the Megatron-LM paper (arXiv 1909.08053): a column-parallel linear followed by a
row-parallel one needs one all-reduce forward (the paper's g) and one backward (its conjugate f).
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# -----------------------------------------------------------------------------
# Process grid


class Grid:
    """Who am I in the (PP, DP, TP) grid, and the process groups I talk to."""

    def __init__(self, tensor_parallel_size=1, pipeline_parallel_size=1):
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if tp < 1 or pp < 1 or self.world_size % (tp * pp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by tensor_model_parallel_size ({tp}) x "
                f"pipeline_model_parallel_size ({pp}); launch a multiple of {tp * pp} processes or change the sizes")
        dp = self.world_size // (tp * pp)
        self.tp_size, self.pp_size, self.dp_size = tp, pp, dp
        self.tp_rank = self.rank % tp
        self.dp_rank = (self.rank // tp) % dp
        self.pp_rank = self.rank // (tp * dp)
        self.is_first_stage = self.pp_rank == 0
        self.is_last_stage = self.pp_rank == pp - 1
        self.next_rank = self._rank_of(self.tp_rank, self.dp_rank, (self.pp_rank + 1) % pp)
        self.prev_rank = self._rank_of(self.tp_rank, self.dp_rank, (self.pp_rank - 1) % pp)
        self.tp_group = self.dp_group = self.pp_group = self.mp_group = self.embedding_group = None
        if not dist.is_initialized():
            return
        # new_group must be called by every rank for every group, in the same order.
        for p in range(pp):
            for d in range(dp):
                self._group("tp_group", [self._rank_of(t, d, p) for t in range(tp)])
        for p in range(pp):
            for t in range(tp):
                self._group("dp_group", [self._rank_of(t, d, p) for d in range(dp)])
        for d in range(dp):
            for t in range(tp):
                ranks = [self._rank_of(t, d, p) for p in range(pp)]
                self._group("pp_group", ranks)
                # The tied word embedding lives on the first and the last stage (seed 001, DeepSpeed PR 1801).
                self._group("embedding_group", sorted({ranks[0], ranks[-1]}))
        for d in range(dp):
            self._group("mp_group", [self._rank_of(t, d, p) for p in range(pp) for t in range(tp)])

    def _rank_of(self, tp_rank, dp_rank, pp_rank):
        return (pp_rank * self.dp_size + dp_rank) * self.tp_size + tp_rank

    def _group(self, attr, ranks):
        group = dist.new_group(ranks)
        if self.rank in ranks:
            setattr(self, attr, group)

    def __repr__(self):
        return (f"Grid(rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size}, "
                f"pp {self.pp_rank}/{self.pp_size}, dp {self.dp_rank}/{self.dp_size})")


grid = Grid()  # single process until init() is called


def init(tensor_parallel_size=1, pipeline_parallel_size=1, backend=None):
    """Start torch.distributed if launched by torchrun and build the grid. Returns the grid."""
    global grid
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    grid = Grid(tensor_parallel_size, pipeline_parallel_size)
    return grid


# -----------------------------------------------------------------------------
# Tensor-parallel communication as autograd functions (the paper's f and g)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=grid.tp_group)
        return grad


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=grid.tp_group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dimension forward, keep my slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(grid.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=grid.tp_group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(grid.tp_size, dim=-1)[grid.tp_rank].contiguous()


def copy_to_tp(x):
    return x if grid.tp_size == 1 else _CopyToTP.apply(x)


def reduce_from_tp(x):
    return x if grid.tp_size == 1 else _ReduceFromTP.apply(x)


def gather_from_tp(x):
    return x if grid.tp_size == 1 else _GatherFromTP.apply(x)


# -----------------------------------------------------------------------------
# Tensor-parallel layers. Split parameters carry `tp_dim`, the dimension cut across TP ranks, so that
# initialisation (model.py) and checkpoint tools can build or check the full tensor and take this rank's slice.


def shard(full, dim):
    """This TP rank's contiguous slice of a full tensor along `dim`."""
    if dim is None or grid.tp_size == 1:
        return full
    return full.chunk(grid.tp_size, dim=dim)[grid.tp_rank]


def _divide(n, parts, what):
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_model_parallel_size ({parts})")
    return n // parts


class ColumnParallelLinear(nn.Linear):
    """Y = X A with A split by columns (output features): each rank computes its own slice of Y."""

    def __init__(self, in_features, out_features, bias=True):
        super().__init__(in_features, _divide(out_features, grid.tp_size, "output features"), bias=bias)
        self.weight.tp_dim = 0
        if bias:
            self.bias.tp_dim = 0

    def forward(self, x):
        return F.linear(copy_to_tp(x), self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """Y = X A with A split by rows (input features): partial products are summed across ranks."""

    def __init__(self, in_features, out_features, bias=True):
        super().__init__(_divide(in_features, grid.tp_size, "input features"), out_features, bias=bias)
        self.weight.tp_dim = 1

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight))
        # The bias is replicated: add it once, after the reduction.
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Embedding table split by vocabulary rows; ids owned by other ranks contribute zeros before the sum."""

    def __init__(self, num_embeddings, embedding_dim):
        super().__init__(_divide(num_embeddings, grid.tp_size, "padded vocabulary"), embedding_dim)
        self.weight.tp_dim = 0
        self.vocab_start = grid.tp_rank * self.num_embeddings

    def forward(self, ids):
        if grid.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary, without ever gathering the full logits."""

    @staticmethod
    def forward(ctx, logits, target):
        group = grid.tp_group
        logits = logits.float()
        lmax = logits.max(dim=-1).values
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        logits = logits - lmax.unsqueeze(-1)
        vocab_local = logits.shape[-1]
        local = target - grid.tp_rank * vocab_local
        outside = (local < 0) | (local >= vocab_local)
        local = local.masked_fill(outside, 0)
        target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, group=group)
        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), (outside.float() - 1.0).unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None


def vocab_parallel_cross_entropy(logits, target):
    """Per-token loss (fp32) from this rank's vocabulary slice of the logits."""
    if grid.tp_size == 1:
        return F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), reduction="none").view_as(target)
    return _VocabParallelCrossEntropy.apply(logits, target)
