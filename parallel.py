"""Hand-written 3D parallelism: tensor (TP), pipeline (PP) and data (DP) parallel.

Ranks are laid out as in Megatron: TP fastest, then DP, then PP, so that the chatty TP group sits inside one
node.  With a single process every piece below degenerates to the plain op (no communication), so model.py
uses these layers unconditionally and reads like a normal GPT.

Tensor parallelism follows the Megatron-LM paper (arXiv 1909.08053): a column-parallel linear followed by a
row-parallel one needs one all-reduce forward (the paper's g) and one backward (its conjugate f).
"""

import datetime
import os
import random
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# The layout's keys and their checks (arguments.Config is made of each owner's keys)


@dataclass
class LayoutConfig:
    # -- parallel: the TP x PP x DP layout, the devices, and what runs on them --
    # tensor_model_parallel_size is a model.GPTConfig field: it pads the vocabulary
    pipeline_model_parallel_size: int = 1  # PP: split the layers into this many stages
    pp_partition_method: str = (
        "type:transformer|embedding"  # or "type:transformer": the embedding not counted
    )
    # every N iterations check that TP-replicated weights agree (0: never)
    tp_replica_check_interval: int = 0
    # when they differ, copy TP rank 0's weights (and their Adam state) over
    tp_replica_resync: bool = False
    # data parallelism by DeepSpeed (ZeRO 1/2, bf16 weights); TP and PP stay ours
    deepspeed: bool = False
    # 1: shard the optimizer state over data parallel (2, with deepspeed: gradients too)
    zero_stage: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # torch.compile the blocks and the loss's elementwise chain (None: on CUDA only)
    compile: bool | None = None
    # bit-reproducible kernels (torch.use_deterministic_algorithms), whatever they cost
    deterministic: bool = False
    # fp32 matmuls on CUDA in TF32 (tensor cores, 10-bit mantissa); False: full fp32 matmuls
    tf32: bool = True
    # how long a training collective waits for the slowest rank: a hang's cost
    distributed_timeout_minutes: int = 10
    # how long ranks wait for one's host work (checkpoint files, data index)
    host_work_timeout_minutes: int = 60
    # size the TP x PP x DP layout and memory per GPU on the meta device, then exit
    dry_run: bool = False

    # sections.py; a check of the TP ranks' copies needs two of them, and only stages have a partition
    SWITCHED = {
        "tp_replica_check_interval": ("tp_replica_resync",),
        "tensor_model_parallel_size>1": ("tp_replica_check_interval",),
        "pipeline_model_parallel_size>1": ("pp_partition_method",),
    }


# Modes of which a run is one, refused together by check(): one given on the command line replaces the config file's
# other one (arguments.load_config)
EXCLUSIVE = (("eval_only", "dry_run"),)


def zero_stage_problem(zero_stage, deepspeed, pp):
    """Why a ZeRO stage cannot run with this layout (pp: its pipeline stages), or None. One text for the
    config's check, before the build, and for deepspeed_engine.check and optim.optimizer_for, which ask again
    where they act."""
    if zero_stage > 2:
        return (
            f"zero_stage={zero_stage} is not supported (ZeRO-3 would shard the "
            "weights our TP/PP layers hold); use zero_stage 1 or 2"
        )
    if not deepspeed and zero_stage > 1:
        return (
            f"zero_stage={zero_stage} needs deepspeed=True (the native path shards "
            "the optimizer state only: zero_stage=1)"
        )
    if deepspeed and zero_stage == 2 and pp > 1:
        return (
            "zero_stage=2 with pipeline_model_parallel_size > 1 is not supported: ZeRO-2 reduces "
            "gradients during backward, before the two stages' tied-embedding gradients are summed "
            "(DeepSpeed refuses it with pipelines too); use zero_stage=1"
        )
    return None


def check(layout_cfg, world_size, *, tp, num_layers, qk_layernorm, eval_only):
    """Raise ValueError with the fix for a layout that cannot run on world_size processes (before the process
    group exists: Grid asks check_world_size again, for the world it finds). layout_cfg: the
    layout's keys (LayoutConfig); tp, num_layers, qk_layernorm: the model's (model.GPTConfig);
    eval_only: the run's mode (report.LoggingConfig)."""

    def need(ok, message):
        if not ok:
            raise ValueError(message)

    pp, deepspeed = layout_cfg.pipeline_model_parallel_size, layout_cfg.deepspeed
    check_world_size(world_size, tp, pp)
    partition_layers(num_layers, pp, layout_cfg.pp_partition_method)  # raises if it cannot be done
    need(not (eval_only and layout_cfg.dry_run), "eval_only and dry_run are exclusive; choose one")
    need(
        not (qk_layernorm and deepspeed and tp > 1),
        "qk_layernorm with deepspeed=True and tensor_model_parallel_size > 1 is not supported (the qk-layernorm "
        "gradients must be summed over TP before DeepSpeed's step); use the native path (deepspeed=False) or TP=1",
    )
    zero = layout_cfg.zero_stage
    need(zero in (0, 1, 2, 3), f"zero_stage={zero} is not 0, 1, 2 or 3")
    problem = zero_stage_problem(zero, deepspeed, pp)
    need(problem is None, problem)
    interval, resync = layout_cfg.tp_replica_check_interval, layout_cfg.tp_replica_resync
    need(interval >= 0, "tp_replica_check_interval must be 0 (off) or a number of iterations")
    need(
        not (resync and deepspeed),
        "tp_replica_resync cannot reach DeepSpeed's fp32 master weights; use deepspeed=False or only the check",
    )
    device = layout_cfg.device
    need(device in ("auto", "cpu", "cuda"), f"device={device!r} is not auto, cpu or cuda")
    for key in ("distributed_timeout_minutes", "host_work_timeout_minutes"):
        minutes = getattr(layout_cfg, key)
        need(minutes >= 1, f"{key}={minutes} must be at least 1 (minutes a wait may last)")


def check_world_size(world_size, tp, pp):
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp}); launch a multiple of {tp * pp} processes or change the sizes"
        )


# -----------------------------------------------------------------------------
# Process grid


class Grid:
    """Who am I in the (PP, DP, TP) grid, and the process groups I talk to."""

    def __init__(self, tensor_parallel_size=1, pipeline_parallel_size=1, world_size=None, rank=0):
        """With world_size given, a grid on paper: sizes and ranks only, no process groups (estimate.py builds
        the model for one with GPT(..., grid=...))."""
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        on_paper = world_size is not None
        if not on_paper:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
            rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size, self.rank = world_size, rank
        check_world_size(world_size, tp, pp)
        dp = self.world_size // (tp * pp)
        self.tp_size, self.pp_size, self.dp_size = tp, pp, dp
        self.tp_rank = self.rank % tp
        self.dp_rank = (self.rank // tp) % dp
        self.pp_rank = self.rank // (tp * dp)
        self.is_first_stage = self.pp_rank == 0
        self.is_last_stage = self.pp_rank == pp - 1
        self.next_rank = self.rank_of(self.tp_rank, self.dp_rank, (self.pp_rank + 1) % pp)
        self.prev_rank = self.rank_of(self.tp_rank, self.dp_rank, (self.pp_rank - 1) % pp)
        self.tp_group = self.dp_group = self.pp_group = self.mp_group = self.embedding_group = None
        if on_paper or not dist.is_initialized():
            return
        # new_group must be called by every rank for every group, in the same order.
        for p in range(pp):
            for d in range(dp):
                self._group("tp_group", [self.rank_of(t, d, p) for t in range(tp)])
        for p in range(pp):
            for t in range(tp):
                self._group("dp_group", [self.rank_of(t, d, p) for d in range(dp)])
        for d in range(dp):
            for t in range(tp):
                ranks = [self.rank_of(t, d, p) for p in range(pp)]
                self._group("pp_group", ranks)
                # The tied word embedding lives on the first and the last stage (lesson 11).
                self._group("embedding_group", sorted({ranks[0], ranks[-1]}))
        for d in range(dp):
            self._group("mp_group", [self.rank_of(t, d, p) for p in range(pp) for t in range(tp)])

    def rank_of(self, tp_rank, dp_rank, pp_rank):
        return (pp_rank * self.dp_size + dp_rank) * self.tp_size + tp_rank

    def _group(self, attr, ranks):
        group = dist.new_group(ranks)
        if self.rank in ranks:
            setattr(self, attr, group)

    def __repr__(self):
        return (
            f"Grid(rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size}, "
            f"pp {self.pp_rank}/{self.pp_size}, dp {self.dp_rank}/{self.dp_size})"
        )


grid = Grid()  # single process until init() is called


PARTITION_METHODS = ("type:transformer|embedding", "type:transformer")


def partition_layers(num_layers, pp_size, method="type:transformer|embedding"):
    """The transformer layers of each pipeline stage: pp_size consecutive ranges covering range(num_layers).

    Megatron-DeepSpeed's --pp-partition-method: the units dealt out are the transformer layers and, with
    'type:transformer|embedding' (what BLOOM-176B used), also the word embedding on the first stage and the
    tied head on the last, one unit each. n units on p stages as evenly as possible: every stage gets n // p
    units and the first n % p one more, which is what DeepSpeed's partition_balanced returns for equal weights.
    BLOOM's 70 layers on 12 stages: 72 units, 6 each, so 5 layers on the first and last stage, 6 in between."""
    if method not in PARTITION_METHODS:
        raise ValueError(
            f"pp_partition_method={method!r} is not one of {', '.join(PARTITION_METHODS)}"
        )
    # units before the first layer (and after the last)
    ends = 1 if method == "type:transformer|embedding" else 0
    units = num_layers + 2 * ends
    if num_layers < 1 or pp_size > units:
        raise ValueError(
            f"num_layers ({num_layers}) is too small for pipeline_model_parallel_size ({pp_size}) "
            f"with pp_partition_method={method!r}: every stage needs a layer (or the embedding or "
            "head); use fewer stages"
        )
    per, extra = divmod(units, pp_size)
    bounds = [0]
    for stage in range(pp_size):
        bounds.append(bounds[-1] + per + (stage < extra))
    return [range(max(0, a - ends), min(num_layers, b - ends)) for a, b in zip(bounds, bounds[1:])]


def init(
    tensor_parallel_size=1,
    pipeline_parallel_size=1,
    backend=None,
    timeout_minutes=10,
    host_timeout_minutes=60,
):
    """Start torch.distributed if launched by torchrun and build the grid. Returns the grid.

    Under NCCL this process's GPU is LOCAL_RANK's, made current and bound to the process group (device_id: the
    communicators are created for it at once, not lazily on whatever device is current at the first
    collective). timeout_minutes: how long a training collective may wait for the slowest rank before the job
    fails -- what a hung rank costs the job. The waits for one rank's host work (its share of a multi-GB
    checkpoint, the data's index) take longer and run on host_group(), with host_timeout_minutes."""
    global grid, host_timeout
    host_timeout = host_timeout_minutes
    if (
        "WORLD_SIZE" in os.environ
        and int(os.environ["WORLD_SIZE"]) > 1
        and not dist.is_initialized()
    ):
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        device = None
        # modulo: one GPU per task (SLURM's, torchrun --virtual-local-rank) is GPU 0
        if backend == "nccl":
            local, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
            device = torch.device("cuda", local % gpus if gpus else local)
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, timeout=datetime.timedelta(minutes=timeout_minutes), device_id=device
        )
        host_groups.clear()  # a group of an earlier process group is gone with it
    grid = Grid(tensor_parallel_size, pipeline_parallel_size)
    return grid


host_timeout, host_groups = 60, []  # init()'s host_timeout_minutes; the group host_group() made


def free_port():
    """A TCP port free on this host for a one-node rendezvous (torchrun --standalone binds its own).

    Taken below the kernel's ephemeral range: between choosing a port and the rendezvous binding it, any
    outgoing connection may be handed an ephemeral one, and the rendezvous fails on EADDRINUSE; a port below the
    range can only be taken by another listener, and the bind below checks there is none now."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    below = range(10000, low)
    # not the global generator: a test that seeds it would draw the same ports every time
    for port in random.SystemRandom().sample(below, min(64, len(below))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:  # no free port below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_group():
    """A gloo group of every rank for the waits on one rank's host work (a checkpoint's files, the data's index),
    with init()'s host timeout: a slow disk does not trip the training collectives' shorter one, which stays what a
    hang costs. Made at the first call, which every rank makes at the same point (new_group is collective)."""
    if not host_groups:
        host_groups.append(
            dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=host_timeout))
        )
    return host_groups[0]


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


def _this(g):
    """The grid a layer is built for: the one given (a grid on paper, estimate.py), else this process's."""
    return grid if g is None else g


def shard(full, dim, grid=None):
    """This TP rank's contiguous slice of a full tensor along `dim`."""
    g = _this(grid)
    if dim is None or g.tp_size == 1:
        return full
    return full.chunk(g.tp_size, dim=dim)[g.tp_rank]


def divide(n, parts, what):
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_model_parallel_size ({parts})")
    return n // parts


def linear(x, weight, bias=None):
    """F.linear(x, weight, bias). In training, a half-precision weight with a GradBuffer (the native path, every
    precision but fp32) gets its gradient added by the backward straight into its fp32 main_grad, as Megatron's
    gradient_accumulation_fusion does: autograd makes no .grad of the weight (a weight-sized bf16 tensor written,
    then read by the post-accumulate hook's add into main_grad: 4 of 12 bytes a parameter a micro-batch;
    docs/speed.md), and the products are not rounded to bf16 before they are summed. The bias stays on autograd.
    fp32 weights keep autograd's path (on the CPU an addmm into a non-zero sum is not bit for bit
    main_grad.add_(product)). Compiled blocks trace the same: the add is a custom op, and the weight's arrival
    (for the GradBuffer's DP buckets) an autograd leaf of its own whose hook runs after the block's backward."""
    if not (
        torch.is_grad_enabled()
        and fuses_weight_gradient(weight)
        and (x.requires_grad or bias is not None and bias.requires_grad)
    ):
        return F.linear(x, weight, bias)
    # the weight goes in detached: no edge to its AccumulateGrad, so no .grad of it is ever made
    return _LinearIntoMainGrad.apply(
        x, weight.detach(), bias, weight.main_grad, weight.main_grad_arrival
    )


def fuses_weight_gradient(weight):
    """Does linear() add this weight's gradient into its main_grad itself? Half-precision trained leaf weights
    with a GradBuffer (which gives them main_grad_arrival; DeepSpeed's path takes .grads)."""
    return (
        weight.dtype in (torch.bfloat16, torch.float16)
        and weight.requires_grad
        and weight.is_leaf
        and getattr(weight, "main_grad_arrival", None) is not None
    )


class _LinearIntoMainGrad(torch.autograd.Function):
    """linear()'s autograd: forward F.linear; backward the input's and the bias's gradients for autograd, the
    weight's added into main_grad, and a zero for `arrival`, a 0-dim leaf whose post-accumulate hook tells the
    GradBuffer that the weight's gradient of this backward is in (GradBuffer.__init__)."""

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad, arrival):
        ctx.save_for_backward(x, weight)
        # not saved for backward: other micro-batches' backwards add into it in between (1F1B), which autograd's
        # version check would refuse
        ctx.main_grad = main_grad
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = g.sum(0) if ctx.needs_input_grad[2] else None
        torch.ops.stablegpt.add_product_(ctx.main_grad, g.t(), x.reshape(-1, x.shape[-1]))
        return grad_x, None, grad_bias, None, ctx.main_grad.new_zeros(())


@torch.library.custom_op("stablegpt::add_product_", mutates_args=("out",))
def _add_product_op(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """add_product as one op that torch.compile keeps whole (its probe and branches are not traced)."""
    add_product(out, a, b)


@_add_product_op.register_fake
def _add_product_shape(out, a, b):
    return None


def add_product(out, a, b):
    """out += a @ b, out fp32 (fp64 in tests) and a, b half precision, without a half-precision product: on CUDA
    the matmul sums into fp32 out itself where this torch has out_dtype (fp32_accumulating_addmm); otherwise on
    CUDA the half product (rounded once), added; on the CPU, which has no such kernel, and for fp64, copies of
    the operands in out's dtype (exact)."""
    fp32 = out.dtype == torch.float32
    if fp32 and fp32_accumulating_addmm(out.device):
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    elif fp32 and out.is_cuda:
        out += a @ b
    else:
        torch.addmm(out, a.to(out.dtype), b.to(out.dtype), out=out)


# device type -> whether addmm takes out_dtype=float32 for half operands, in place
FP32_ACCUMULATING_ADDMM = {}


def fp32_accumulating_addmm(device):
    """Whether torch.addmm(c, a, b, out_dtype=torch.float32, out=c) adds half-precision a @ b into fp32 c (CUDA,
    a recent torch): tried once per process on a 2 x 2 problem; never on the CPU, which has no such kernel."""
    if device.type != "cuda":
        return False
    if device.type not in FP32_ACCUMULATING_ADDMM:
        c, a = (
            torch.ones(2, 2, device=device),
            torch.ones(2, 2, device=device, dtype=torch.bfloat16),
        )
        try:
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
            # one sync, the first call's
            FP32_ACCUMULATING_ADDMM[device.type] = bool((c == 3.0).all())
        except (RuntimeError, TypeError, NotImplementedError):
            FP32_ACCUMULATING_ADDMM[device.type] = False
    return FP32_ACCUMULATING_ADDMM[device.type]


class ColumnParallelLinear(nn.Linear):
    """Y = X A with A split by columns (output features): each rank computes its own slice of Y."""

    def __init__(self, in_features, out_features, bias=True, grid=None):
        super().__init__(
            in_features, divide(out_features, _this(grid).tp_size, "output features"), bias=bias
        )
        self.weight.tp_dim = 0
        if bias:
            self.bias.tp_dim = 0

    def forward(self, x):
        return linear(copy_to_tp(x), self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """Y = X A with A split by rows (input features): partial products are summed across ranks."""

    def __init__(self, in_features, out_features, bias=True, grid=None):
        super().__init__(
            divide(in_features, _this(grid).tp_size, "input features"), out_features, bias=bias
        )
        self.weight.tp_dim = 1

    def forward(self, x):
        if grid.tp_size == 1:  # nothing to reduce: one addmm instead of a matmul and an add
            return linear(x, self.weight, self.bias)
        y = reduce_from_tp(linear(x, self.weight))
        # The bias is replicated: add it once, after the reduction.
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Embedding table split by vocabulary rows; ids owned by other ranks contribute zeros before the sum."""

    def __init__(self, num_embeddings, embedding_dim, grid=None):
        g = _this(grid)
        rows = divide(num_embeddings, g.tp_size, "padded vocabulary")
        # Left uninitialized: the model's init_weights draws every weight, so nn.Embedding's own normal_ would be
        # thrown away (a BLOOM-sized table: 3.6e9 draws), and on the meta device (model.census) it imports
        # torch._dynamo, ~2 s of a process that builds no optimizer (estimate.py).
        super().__init__(rows, embedding_dim, _weight=torch.empty(rows, embedding_dim))
        self.weight.tp_dim = 0
        self.vocab_start = g.tp_rank * self.num_embeddings

    def forward(self, ids):
        if grid.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary, without ever gathering the full logits.

    The logits are the largest activation of a GPT (tokens x vocabulary): as in Megatron they are copied once,
    shifted by their max, and everything after happens in that copy (exp, softmax, and in backward the gradient
    softmax - onehot). Also used with TP=1, where it allocates half the memory F.cross_entropy does.

    Columns from vocab_size on are padding (the vocabulary is padded to a multiple of 128 x TP): they are set to
    -inf in the copy, so they take no probability and get no gradient, and the model is the same function
    whatever the padding, hence whatever the TP size.

    z_loss (PaLM's auxiliary loss, lesson 20) rides on the same pass: log Z = log(sum exp) + max is already at
    hand, and d(z_loss * log(Z)^2)/d logits = 2 * z_loss * log(Z) * softmax, so the gradient becomes
    softmax * (1 + 2 * z_loss * log Z) - onehot. The returned loss keeps the value of the cross-entropy alone
    (what the log calls lm loss) while its gradient is that of cross-entropy + z_loss * log(Z)^2: whatever
    reduction the caller applies to the per-token loss (the mean) applies to the z-loss too. log Z comes back
    alongside, without a gradient, for logging the z-loss."""

    @staticmethod
    def forward(ctx, logits, target, vocab_size, z_loss):
        group = grid.tp_group
        dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)
        vocab_local = logits.shape[-1]
        # my columns that are tokens
        real = min(max(vocab_size - grid.tp_rank * vocab_local, 0), vocab_local)
        if real:  # exact: the max of fp16/bf16 numbers is one of them
            lmax = logits[..., :real].amax(dim=-1).to(dtype)
        else:  # a slice of padding only (possible with a large TP): the other ranks have the max
            lmax = logits.new_full(logits.shape[:-1], float("-inf"), dtype=dtype)
        if grid.tp_size > 1:
            dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        # the one copy, in `dtype` by type promotion; the caller's is intact
        logits = logits - lmax.unsqueeze(-1)
        if real < vocab_local:
            # exp() = 0: no probability, and softmax - onehot = 0 there
            logits[..., real:] = float("-inf")
        local = target - grid.tp_rank * vocab_local
        outside = (local < 0) | (local >= vocab_local)
        local = local.masked_fill(outside, 0)
        target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        softmax = logits.exp_()
        sum_exp = softmax.sum(dim=-1)
        if grid.tp_size > 1:
            dist.all_reduce(target_logit, group=group)
            dist.all_reduce(sum_exp, group=group)
        softmax.div_(sum_exp.unsqueeze(-1))
        log_sum_exp = sum_exp.log()
        log_z = log_sum_exp + lmax
        if z_loss:  # the z-loss's share of the gradient, folded into the saved softmax now (backward runs once)
            softmax.mul_((1.0 + 2.0 * z_loss * log_z).unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        ctx.mark_non_differentiable(log_z)
        return log_sum_exp - target_logit, log_z

    @staticmethod
    def backward(ctx, grad, _grad_log_z):
        softmax, local, outside = ctx.saved_tensors
        # softmax - onehot(target), written over the saved softmax (backward runs once: no retain_graph)
        grad_logits = softmax.scatter_add_(
            -1, local.unsqueeze(-1), (outside.to(softmax.dtype) - 1.0).unsqueeze(-1)
        )
        return grad_logits.mul_(grad.unsqueeze(-1)), None, None, None


def vocab_parallel_cross_entropy(logits, target, vocab_size=None, z_loss=0.0):
    """(per-token loss, per-token log Z) from this rank's vocabulary slice of the logits, in fp32 (fp64 for fp64
    logits); columns of token ids >= vocab_size (padding) are left out of the softmax. With z_loss > 0 the
    loss's gradient includes z_loss * log(Z)^2 (its value does not)."""
    if vocab_size is None:
        vocab_size = logits.shape[-1] * grid.tp_size
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, z_loss)


def unwrap(model):
    """The GPT stage inside a DeepSpeed engine (or the model itself)."""
    return getattr(model, "module", model)


def backward(out, grad=None):
    """out.backward(grad): a stage's loss, or its output with the gradient that came back from the next stage."""
    torch.autograd.backward(out, grad)


# -----------------------------------------------------------------------------
# Pipeline parallelism: point-to-point messages between neighbouring stages and the 1F1B schedule
#
# Every stage reads the same micro-batches (train.py builds them on every rank), so the shape of a message is
# known on both sides -- (micro batch, sequence length, hidden) with the sequence length of *this* batch, which
# the curriculum changes from step to step -- and only the tensor itself travels.

# Host seconds this process spent in the 1F1B schedule and, inside it, in communicate(): posting the messages
# and waiting for the neighbouring stages. bench.py reads them as each stage's pipeline bubble. On CUDA the host
# does not wait (NCCL's wait() makes the stream wait), so bench.py sets pipeline_events to {"schedule": [],
# "communicate": []} and gets (start, end) CUDA events on the current stream of each, to read after a sync.
pipeline_seconds = {"schedule": 0.0, "communicate": 0.0}
pipeline_events = None


def pipeline_event(device):
    """A CUDA event recorded now on the current stream, when bench.py collects them; else None."""
    if pipeline_events is None or torch.device(device).type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def pipeline_time(kind, start, start_event, device):
    pipeline_seconds[kind] += time.perf_counter() - start
    if start_event is not None:
        pipeline_events[kind].append((start_event, pipeline_event(device)))


def communicate(send_next=None, send_prev=None, recv_prev=None, recv_next=None):
    """Post all sends and receives at once and wait for all of them. recv_* are buffers to fill (or None).

    Posting both directions as one batch is what keeps neighbours that send to each other at the same moment
    from deadlocking (steady state of 1F1B: my activation goes down while an older micro-batch's gradient comes
    up); under NCCL the batch is one group, where separate blocking calls would wait on each other.
    """
    posts = [
        (op, tensor, peer)
        for op, tensor, peer in (
            (dist.isend, send_next, grid.next_rank),
            (dist.isend, send_prev, grid.prev_rank),
            (dist.irecv, recv_prev, grid.prev_rank),
            (dist.irecv, recv_next, grid.next_rank),
        )
        if tensor is not None
    ]
    ops = [dist.P2POp(*post) for post in posts]
    if ops:
        device = posts[0][1].device
        start, start_event = time.perf_counter(), pipeline_event(device)
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        pipeline_time("communicate", start, start_event, device)
    return recv_prev, recv_next


def pipeline_forward_backward(model, batches, loss_scale=1.0, forward_only=False, packing=None):
    """Run this stage's part of forward (and backward) over all micro-batches with the 1F1B schedule.

    Warm-up: stage s runs pp - s - 1 forwards so that the last stage can start; steady state: one forward then
    one backward, so at most pp - s micro-batches hold activations here; cool-down: the remaining backwards
    (PipeDream-Flush, arXiv 2104.04473). Each micro-batch's loss is divided by the number of micro-batches
    and multiplied by loss_scale before backward, exactly as training.forward_backward does with one stage.
    Returns the mean loss on the last stage and 0 elsewhere (average_loss broadcasts the real one). packing(tokens):
    the model's keyword inputs of packed documents (loader.packing), made by every stage from its own copy."""
    stage = PipelineStage(model, batches, loss_scale, forward_only, packing)
    start, start_event = time.perf_counter(), pipeline_event(stage.device)
    (all_forward if forward_only else one_forward_one_backward)(stage)
    pipeline_time("schedule", start, start_event, stage.device)
    return stage.total / len(batches)


class PipelineStage:
    """This stage's steps on one global batch's micro-batches (buffers, forward, backward), ordered by a schedule."""

    def __init__(self, model, batches, loss_scale, forward_only, packing):
        self.model, self.batches, self.loss_scale, self.packing = (
            model,
            batches,
            loss_scale,
            packing,
        )
        self.forward_only, self.m, self.gpt = forward_only, len(batches), unwrap(model)
        self.device = batches[0][0].device
        # Activations and their gradients cross stage boundaries in the compute dtype, that of the weights:
        # fp16/bf16 under mixed precision (half the traffic of fp32, as in Megatron), fp32 otherwise.
        self.dtype = next(self.gpt.parameters()).dtype
        self.total = torch.zeros((), device=self.device)

    # receive buffer for micro-batch i's activation or its gradient: (batch, seq, hidden)
    def buffer(self, i):
        return torch.empty(
            *self.batches[i][0].shape,
            self.gpt.config.hidden_size,
            dtype=self.dtype,
            device=self.device,
        )

    def activation(self, i):  # what comes from the previous stage (nothing on the first)
        return None if grid.is_first_stage else self.buffer(i)

    def gradient(self, i):  # what comes back from the next stage (nothing on the last)
        return None if grid.is_last_stage else self.buffer(i)

    def forward(self, i, received):
        x, y = self.batches[i]
        if received is not None and not self.forward_only:
            received.requires_grad_()
        packed = self.packing(x) if self.packing else {}
        out = self.model(
            x if grid.is_first_stage else received, y if grid.is_last_stage else None, **packed
        )
        if grid.is_last_stage:
            self.total += out.detach()
            return out * (self.loss_scale / self.m)  # backward starts from here
        return out

    def backward(self, received, out, grad_out):
        backward(out, None if grid.is_last_stage else grad_out.to(out.dtype))
        return None if received is None else received.grad.to(self.dtype).contiguous()

    def sendable(self, out):
        return None if grid.is_last_stage else out.detach().to(self.dtype).contiguous()


def all_forward(stage):
    """Evaluation: each micro-batch's forward, received from the previous stage and sent to the next."""
    for i in range(stage.m):
        received, _ = communicate(recv_prev=stage.activation(i))
        communicate(send_next=stage.sendable(stage.forward(i, received)))


def one_forward_one_backward(stage):
    """1F1B: warm-up forwards, then a forward and a backward in turn, then the remaining backwards."""
    # warm-up: forwards only, until the micro-batches in flight fill the stages after this one
    m, warmup = stage.m, min(grid.pp_size - grid.pp_rank - 1, stage.m)
    # (received input, output) of micro-batches waiting for their backward, oldest first
    in_flight = []
    for i in range(warmup):
        received, _ = communicate(recv_prev=stage.activation(i))
        out = stage.forward(i, received)
        communicate(send_next=stage.sendable(out))
        in_flight.append((received, out))
    # steady state: forward micro-batch i, then backward the oldest one in flight (1F1B)
    received = communicate(recv_prev=stage.activation(warmup))[0] if warmup < m else None
    for i in range(warmup, m):
        out = stage.forward(i, received)
        in_flight.append((received, out))
        _, grad_out = communicate(
            send_next=stage.sendable(out), recv_next=stage.gradient(i - warmup)
        )
        grad_in = stage.backward(*in_flight.pop(0), grad_out)
        received, _ = communicate(
            send_prev=grad_in, recv_prev=stage.activation(i + 1) if i + 1 < m else None
        )
    # cool-down: the backwards of the warm-up's micro-batches
    for j in range(m - warmup, m):
        _, grad_out = communicate(recv_next=stage.gradient(j))
        communicate(send_prev=stage.backward(*in_flight.pop(0), grad_out))


# -----------------------------------------------------------------------------
# Data parallelism and the numbers every rank must agree on
#
# Every tensor handed to a collective lives on the backend's communication device: NCCL takes CUDA tensors only
# (a CPU tensor raises), gloo takes CPU tensors. Model tensors (losses, gradients, activations) are on the
# model's device, which train.py makes the backend's; Python numbers go through the scalar helpers below.


def comm_device(backend=None):
    """The device of the tensors a collective takes: the current CUDA device under NCCL, else the CPU."""
    if backend is None and dist.is_initialized():
        backend = dist.get_backend()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_scalars(values, src=0, group=None):
    """Rank src's Python numbers on every rank of `group` (src is a global rank): one collective, one sync."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    dist.broadcast(t, src=src, group=group)
    return t.tolist()


def average_loss(loss):
    """Mean over data parallel of the last stage's loss, then broadcast down the pipeline, so that every rank
    sees the same value (NaN detection, logging, skip decisions)."""
    loss = loss.detach().clone()
    if grid.dp_size > 1:
        dist.all_reduce(loss, group=grid.dp_group)
        loss /= grid.dp_size
    if grid.pp_size > 1:
        dist.broadcast(
            loss,
            src=grid.rank_of(grid.tp_rank, grid.dp_rank, grid.pp_size - 1),
            group=grid.pp_group,
        )
    return loss


def _buckets(tensors, bucket_numel):
    """Consecutive runs of same-dtype tensors of about bucket_numel elements (one collective per run)."""
    bucket, size = [], 0
    for t in tensors:
        if bucket and (size + t.numel() > bucket_numel or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


def all_reduce_mean(tensors, group, size, bucket_numel=2**24):
    """In-place mean of `tensors` across `group`, flattened into buckets: one all-reduce per ~64 MB instead of
    one per parameter."""
    for bucket in _buckets(tensors, bucket_numel):
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        flat /= size
        for t, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            t.copy_(reduced)


class GradBuffer:
    """Where the gradients of the native path go: Megatron's gradient buffers, DDP's buckets.

    Every parameter gets `main_grad`, a view into one of a few flat buckets of `dtype`: fp32 in every precision
    (Megatron's accumulate_allreduce_grads_in_fp32: a bf16 sum of 64 micro-batches keeps 8 bits of mantissa,
    lesson 6; fp16's 11 lose 1.9e-3 over 256, precision.py). A hook that runs
    after autograd has accumulated a parameter's .grad adds it into main_grad and frees it, so micro-batches
    accumulate in `dtype` whatever the parameter's dtype, and no .grad outlives its micro-batch. A gradient made
    outside autograd (the output layer's, which cross_entropy computes in the loss's forward) goes into main_grad
    through add(), without a .grad at all (each parameter's `main_grad_buffer` is this buffer); so does a
    half-precision linear weight's, added by linear()'s backward, which its `main_grad_arrival` leaf counts in.

    Data parallel (a group of size > 1): during the last micro-batch's backward, a bucket is all-reduced
    asynchronously as soon as all its parameters have their final gradient, while backward goes on through the
    earlier layers. Buckets hold parameters in reverse model order (about the order backward finishes them) and
    are launched strictly in order, so every rank issues the same collectives in the same order, as DDP does.
    Each bucket is divided by the DP size before the sum, as Megatron does (an fp16 sum could overflow).
    finish() launches what is left (buckets with a parameter that got no gradient) and waits for all.
    """

    def __init__(self, params, dtype, group=None, size=1, bucket_numel=2**22):
        self.params = [p for p in params if p.requires_grad]
        self.group = group if size > 1 else None
        self.size = size
        self.index = {p: i for i, p in enumerate(self.params)}
        self.buckets, self.members, self.bucket_of = [], [], {}
        chunk, numel = [], 0
        for i in reversed(range(len(self.params))):
            chunk.append(i)
            numel += self.params[i].numel()
            if numel >= bucket_numel or i == 0:
                self._add_bucket(chunk, numel, dtype)
                chunk, numel = [], 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._accumulate)
            p.main_grad_buffer = self
            # linear() adds these weights' gradients itself
            if p.dtype in (
                torch.bfloat16,
                torch.float16,
            ):
                p.main_grad_arrival = self._arrival(p)
        self.countdown = None  # per parameter: gradients still to come this step (armed by start())
        self.handles = []

    def _add_bucket(self, members, numel, dtype):
        flat = torch.zeros(numel, dtype=dtype, device=self.params[members[0]].device)
        self.point(flat, members)
        for i in members:
            self.bucket_of[i] = len(self.buckets)
        self.buckets.append(flat)
        self.members.append(members)

    def point(self, flat, members):
        """Each member's main_grad a view of its place in the flat bucket (also the guard's Fp32Step's)."""
        offset = 0
        for i in members:
            p = self.params[i]
            p.main_grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def start(self, micro_batches):
        """Zero the gradients before the first micro-batch of a step that runs `micro_batches` backwards."""
        for p in self.params:
            p.grad = None
        for flat in self.buckets:
            flat.zero_()
        self.countdown = [micro_batches] * len(self.params)
        # per bucket: parameters whose gradient is not final
        self.missing = [len(m) for m in self.members]
        self.launched, self.handles = 0, []

    def _accumulate(self, p):
        # a compiled block's backward hands linear()'s weights an undefined gradient: the
        if p.grad is None:
            return  # weight's gradient is in main_grad already, and its main_grad_arrival counts it
        p.main_grad.add_(p.grad)
        p.grad = None
        self._arrived(p)

    def add(self, p, grad, scale=None):
        """main_grad += grad * scale (a 0-dim tensor, or None: 1), p's gradient of this backward computed outside
        autograd, in one pass over main_grad, called during backward.
        It is p's last one unless autograd still brings p a .grad in this backward (the output layer's weight is
        the word embedding's on one stage): then that .grad's hook counts p's gradient as complete."""
        p.main_grad.add_(grad) if scale is None else p.main_grad.addcmul_(grad, scale)
        if not torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(p).node):
            self._arrived(p)

    def _arrival(self, p):
        """A 0-dim leaf standing for p's gradient in autograd where linear() adds it into main_grad itself: its
        post-accumulate hook counts p's gradient as arrived. Fine-grained as p's own .grad hook even in a compiled
        block (whose one backward node hands every leaf its gradient at its end)."""
        arrival = torch.zeros((), device=p.device, requires_grad=True)

        def arrived(token):
            token.grad = None
            self._arrived(p)

        arrival.register_post_accumulate_grad_hook(arrived)
        return arrival

    def _arrived(self, p):
        """p's gradient of this backward is all in main_grad: launch the buckets this completes (last micro-batch)."""
        if self.group is None or self.countdown is None:
            return
        i = self.index[p]
        self.countdown[i] -= 1
        if self.countdown[i] == 0:
            self.missing[self.bucket_of[i]] -= 1
            while self.launched < len(self.buckets) and self.missing[self.launched] == 0:
                self._launch()

    def _launch(self):
        flat = self.buckets[self.launched]
        flat.div_(self.size)
        self.handles.append(dist.all_reduce(flat, group=self.group, async_op=True))
        self.launched += 1

    def finish(self):
        """Wait for the DP mean of every bucket (launching those that backward did not complete)."""
        if self.group is not None and self.countdown is not None:
            while self.launched < len(self.buckets):
                self._launch()
            for handle in self.handles:
                handle.wait()
        self.countdown, self.handles = None, []


def attach_grad_buffer(model, dtype, bucket_numel=2**22):
    """Give a stage model its GradBuffer over this rank's DP group (not under DeepSpeed, which has its own)."""
    gpt = unwrap(model)
    gpt.grad_buffer = GradBuffer(gpt.parameters(), dtype, grid.dp_group, grid.dp_size, bucket_numel)
    return gpt.grad_buffer


def grad_buffer(model):
    return getattr(unwrap(model), "grad_buffer", None)


def main_grad(p):
    """A parameter's gradient: its GradBuffer view (native path) or .grad (DeepSpeed)."""
    return getattr(p, "main_grad", p.grad)


def reduce_gradients(model, data_parallel=True):
    """Make every gradient what one process would have computed for the whole global batch.

    1. Data parallel: the mean over the DP group. With a GradBuffer it was started during backward: wait for it.
       Without one (DeepSpeed, which does its own: data_parallel=False), one pass over the .grads.
    2. Tied embedding: the first stage's embedding and the last stage's output_weight are one parameter; each
       stage holds the part of its gradient from its own use, and their sum is the real gradient. Summing it
       into both copies every step keeps them bitwise identical, so the two optimizers make the same update
       (lesson 11: DeepSpeed forgot this, only the front copy learned, and the run spiked on restart, PR 1801).
       Done after the DP mean so both copies add the same two tensors (a + b == b + a bit for bit).
    3. Replicated TP parameters used by each rank on its own share of the work (`tp_partial`: the qk-layernorm
       weights, shared by all heads while each rank computes only its heads) hold a partial gradient: summed
       over TP, once per step (Megatron-LM does the same for qk-layernorm and sequence-parallel LayerNorms).
    Other replicated TP parameters (LayerNorms, row-parallel biases) need nothing: their gradients are computed
    from identical inputs on every TP rank (tests/test_parallel.py checks it; Megatron-DeepSpeed #271)."""
    gpt = unwrap(model)
    buffer = grad_buffer(gpt)
    if buffer is not None:
        buffer.finish()
    else:
        params = [p for p in gpt.parameters() if p.requires_grad]
        for p in params:  # a parameter unused this step still has to take part in the collectives
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if data_parallel and grid.dp_size > 1:
            all_reduce_mean([p.grad for p in params], grid.dp_group, grid.dp_size)
    partial = [
        main_grad(p)
        for p in gpt.parameters()
        if p.requires_grad and getattr(p, "tp_partial", False)
    ]
    if partial and grid.tp_size > 1:
        all_reduce_mean(partial, grid.tp_group, 1)  # a sum: "mean" over a size of 1
    # an output layer of its own has no copy to sum
    tied = not gpt.config.untie_embeddings_and_output_weights
    # PP=1: one copy, nothing to sum
    if tied and grid.pp_size > 1 and (grid.is_first_stage or grid.is_last_stage):
        dist.all_reduce(main_grad(gpt.word_embedding_weight()), group=grid.embedding_group)


@torch.no_grad()
def check_tp_replicas(model, resync=False, optimizer=None):
    """Do the replicated parameters (LayerNorms, row-parallel biases: whole on every TP rank) still agree with
    TP rank 0's copies? BigScience saw them drift apart on GPUs (lesson 18). One broadcast of the replicated
    parameters over the TP group (they are small: a few vectors of size hidden per layer) and one all-reduce of
    the result. Returns (the largest |difference| over all ranks, [(name, |difference|)] of this rank's
    parameters that differ). resync=True then copies TP rank 0's values in, and its optimizer state of them
    (our optimizers or ZeroShardedOptimizer; a parameter's ZeRO owner is the same DP rank on every TP rank)."""
    gpt = unwrap(model)
    replicated = [(n, p) for n, p in gpt.named_parameters() if getattr(p, "tp_dim", None) is None]
    device = next(gpt.parameters()).device
    diffs = torch.zeros(len(replicated) + 1, dtype=torch.float32, device=device)
    if grid.tp_size > 1 and replicated:
        src = grid.rank_of(0, grid.dp_rank, grid.pp_rank)
        i = 0
        for bucket in _buckets([p for _, p in replicated], 2**24):
            reference = torch._utils._flatten_dense_tensors(bucket)
            dist.broadcast(reference, src=src, group=grid.tp_group)
            for p, ref in zip(bucket, torch._utils._unflatten_dense_tensors(reference, bucket)):
                diffs[i] = (p - ref).abs().max()  # NaN if either copy is NaN: a difference too
                if resync:
                    p.copy_(ref)
                i += 1
        if resync:
            state = (
                getattr(optimizer, "optimizer", optimizer).state if optimizer is not None else {}
            )
            # the optimizer steps fp32 masters of half-precision weights (precision.py): those are resynced too
            main_param = getattr(optimizer, "main_param", lambda p: p)
            for _, p in replicated:
                main = main_param(p)
                if main is not None and main is not p:
                    dist.broadcast(main, src=src, group=grid.tp_group)
                # every tensor of the state on the weight's device, whatever its shape: 8-bit Adam's codes
                # are only read with their per-block scales (absmax). Not a step count kept on the host
                # (torch.optim's): the same on every rank, and NCCL broadcasts device tensors only.
                for t in state.get(main, {}).values():
                    if torch.is_tensor(t) and t.device == main.device:
                        dist.broadcast(t, src=src, group=grid.tp_group)
    diffs = torch.nan_to_num(diffs, nan=float("inf"))
    diffs[-1] = diffs[:-1].max() if replicated else 0.0
    worst = diffs[-1:].clone()
    if dist.is_initialized():
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    worst = worst.item()
    differ = []
    if worst > 0:  # rare: then say which parameters, on each rank
        differ = [(n, d) for (n, _), d in zip(replicated, diffs[:-1].tolist()) if d > 0]
    return worst, differ


def log_tp_replicas(model, optimizer, iteration, resync):
    """check_tp_replicas at an iteration of the loop, logged (lesson 18): the largest difference by
    rank 0, the parameters that differ by each rank that holds them; re-synced from TP rank 0 if
    asked."""
    worst, differ = check_tp_replicas(model, resync=resync, optimizer=optimizer)
    if differ:
        listed = ", ".join(f"{name} ({d:.3e})" for name, d in differ[:8])
        print(
            f" rank {grid.rank} (TP rank {grid.tp_rank}): {len(differ)} replicated parameter(s) "
            f"differ from TP rank 0: {listed}{' ...' if len(differ) > 8 else ''}",
            flush=True,
        )
    if grid.rank == 0:  # the ground floor has no report.print0
        action = " | re-synced from TP rank 0" if resync and worst > 0 else ""
        print(
            f" TP replica check at iteration {iteration} | max abs difference from TP rank 0: "
            f"{worst:.3e}{action} |",
            flush=True,
        )


def counted_once(model):
    """The parameters that make up the model exactly once across the model-parallel group: TP-split ones on
    every TP rank, replicated ones on TP rank 0 only, and not the last stage's copy of the tied embedding."""
    gpt = unwrap(model)
    # GPT's duplicate of the embedding (None unless PP > 1)
    copy = getattr(gpt, "output_weight", None)
    return [
        p
        for p in gpt.parameters()
        if p is not copy and (getattr(p, "tp_dim", None) is not None or grid.tp_rank == 0)
    ]


# Elements of a gradient the CPU's grad_norm takes at a time: the norm's fp64 copy of a whole gradient (the
# vocabulary's: 155 MB at 384 x 50304) is past glibc's largest mmap threshold (32 MiB), which hands it fresh pages
# that the kernel faults in and zeroes on every step (38k faults); an 8 MiB copy is served from memory freed before.
NORM_PIECE = 2**20


def grad_norm(model):
    """Global L2 norm of the gradient (after reduce_gradients), the same on every rank: the squares of this
    rank's share (counted_once) summed over TP and PP ranks. DP ranks hold identical reduced gradients."""
    grads = [g for g in map(main_grad, counted_once(model)) if g is not None and g.numel()]
    device = next(unwrap(model).parameters()).device
    # Accumulated in fp64: fp16 would overflow, and an fp32 sum over millions of elements (CPU kernels) is off
    # by 1e-5, which clipping turns into runs that drift apart with the layout (TP=2 against one process).
    square = torch.zeros((), dtype=torch.float64, device=device)
    if grads and device.type == "cpu":  # the fp64 copies in pieces the allocator keeps (NORM_PIECE)
        grads = [piece for g in grads for piece in g.reshape(-1).split(NORM_PIECE)]
    if grads:
        square = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum()
    if grid.mp_group is not None and grid.tp_size * grid.pp_size > 1:
        dist.all_reduce(square, group=grid.mp_group)
    return square.sqrt()


def count_zeros(model):
    """Megatron's "num zeros" over the whole model (each parameter once), the same on every rank: a 0-dim int64
    tensor on the model's device, read by the caller with its other numbers (one host sync per iteration)."""
    grads = [g for g in map(main_grad, counted_once(model)) if g is not None]
    if grads:  # the element count rides in as the kernel's scalar: a tensor built from it would be a host copy
        zeros = (
            sum(g.numel() for g in grads)
            - torch.stack([torch.count_nonzero(g) for g in grads]).sum()
        )
    else:
        zeros = torch.zeros((), dtype=torch.int64, device=next(unwrap(model).parameters()).device)
    if grid.mp_group is not None and grid.tp_size * grid.pp_size > 1:
        dist.all_reduce(zeros, group=grid.mp_group)
    return zeros


# -----------------------------------------------------------------------------
# Native ZeRO stage 1: each data-parallel rank keeps the optimizer state of a shard of the parameters


def deal_out(sizes, ranks):
    """The rank of each of `sizes` (parameters' element counts, in model order) under native ZeRO-1: each to the
    rank that holds the fewest elements so far (estimate.py and snapshots.py size the largest rank with it)."""
    owners, load = [], [0] * ranks
    for size in sizes:
        rank = load.index(min(load))
        owners.append(rank)
        load[rank] += size
    return owners


def shard_numels(sizes, ranks):
    """Elements each rank holds under deal_out: the optimizer state of its shard is this many parameters'."""
    load = [0] * ranks
    for size, rank in zip(sizes, deal_out(sizes, ranks)):
        load[rank] += size
    return load


class ZeroShardedOptimizer:
    """Each DP rank builds the optimizer of its own shard of the parameters, steps it, then every rank broadcasts
    what it updated (ZeRO-1, arXiv 1910.02054). Gradients are still all-reduced in full (GradBuffer); the saving
    is the optimizer's state: Adam's two moments and, under mixed precision, the fp32 master weights (12 bytes
    per parameter) are divided by DP. The broadcast carries the model's weights in their own (half) dtype.

    Parameters are dealt out whole, in model order, each to the rank that holds the fewest elements so far:
    deterministic, so the same topology finds its shard again in its own rank file on resume. The update of a
    parameter is the same elementwise arithmetic as without sharding, so the weights are bitwise identical.
    Anything else (prepare_grads, refresh_fp32_params) is the shard optimizer's."""

    def __init__(self, params, build):
        """params: this stage's parameters in model order; build(shard) makes the optimizer of a list of them."""
        self.params = [p for p in params if p.requires_grad]
        self.owner = dict(
            zip(self.params, deal_out([p.numel() for p in self.params], grid.dp_size))
        )
        self.optimizer = build([p for p in self.params if self.owner[p] == grid.dp_rank])

    def __getattr__(self, name):
        if name == "optimizer":  # not built yet (or unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):  # every parameter's gradient, not only this rank's shard
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        self.broadcast({p: p for p in self.params})

    @torch.no_grad()
    def broadcast(self, tensors):
        """Every rank gets the owner's tensors[p] (p: a parameter; the same keys on every rank), one call per owner."""
        for rank in range(grid.dp_size):
            mine = [tensors[p] for p in self.params if self.owner[p] == rank and p in tensors]
            if not mine:
                continue
            flat = torch._utils._flatten_dense_tensors(mine)
            dist.broadcast(
                flat, src=grid.rank_of(grid.tp_rank, rank, grid.pp_rank), group=grid.dp_group
            )
            for t, new in zip(mine, torch._utils._unflatten_dense_tensors(flat, mine)):
                t.copy_(new)

    def state_dict(self):
        return {
            "zero_stage": 1,
            "dp_rank": grid.dp_rank,
            "dp_size": grid.dp_size,
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state):
        if (
            state.get("zero_stage") != 1
            or state["dp_size"] != grid.dp_size
            or state["dp_rank"] != grid.dp_rank
        ):
            raise ValueError(
                "the optimizer state in the checkpoint is not this rank's ZeRO-1 shard (saved without "
                "zero_stage=1 or with another data-parallel size); resume with the same zero_stage "
                "and number of processes, or set no_load_optim"
            )
        self.optimizer.load_state_dict(state["optimizer"])
