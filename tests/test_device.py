"""Correct on a device the tests never see: the CUDA path checked on CPU, by construction.

Every user trains on NVIDIA GPUs and no GPU runs these tests, so what would break there is made to break here:
- construction: the initial weights do not depend on the ambient device (torch.device(...) around the build),
  are drawn once, on the CPU, for this rank's slice, in chunks, with the bits of one draw of the whole tensor;
- one training step with every tensor on the `meta` device (see test_train_step_on_meta for why it stands in
  for CUDA), its host syncs counted: as many with 8 micro-batches as with 2;
- every collective and point-to-point call of 2-process gloo runs recorded: on the model's device, contiguous,
  in a dtype NCCL takes, no object collective inside the training loop;
- the RNG state saved and restored is the current CUDA device's only; the process group binds the GPU and
  waits long enough for checkpoint writes; TF32 and expandable segments are asked for on CUDA only;
- telemetry's update/param ratio is the fp32 masters' (a bf16 update mostly rounds away);
- marked `cuda` (python -m pytest -m cuda, skipped without a GPU): the same on a GPU.
"""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import builders
import launch as launcher
import model as model_module
import optim
import parallel
from builders import build_model, build_optimizer
from helpers import (  # noqa: F401
    E2E_ARGS,
    SMALL,
    assert_same_training,
    corpus,
    launch,
    losses,
    plan_of,
    run_cli,
    snapshots_of,
    spike_guard_of,
    synthetic_corpus,  # (corpus, synthetic_corpus: fixtures)
    train_script,
    two_rank_checks,
)
from model import GPT, GPTConfig, draw_slice
from parallel import LayoutConfig
from sections import section
from training import backward, whole_step

CFG = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=1000,
    make_vocab_size_divisible_by=64,
    embed_layernorm=True,
)


def _weights(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -----------------------------------------------------------------------------
# Construction


@pytest.mark.parametrize(
    "switches", [{}, dict(embed_init="xavier_uniform", position_embedding_init="sinusoidal")]
)
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
    """builders.build_model for the CPU called inside another ambient device builds the same model, on the CPU."""
    import arguments

    cfg = arguments.prepare(
        arguments.load_config(
            [
                "--num_layers=2",
                "--hidden_size=32",
                "--num_attention_heads=4",
                "--seq_length=16",
                "--vocab_size=1000",
                "--seed=5",
                "--embed_layernorm",
            ]
        )
    )
    reference = _weights(build_model(cfg, torch.device("cpu")))
    with torch.device("meta"):
        built = build_model(cfg, torch.device("cpu"))
    assert all(p.device.type == "cpu" for p in built.parameters())
    _assert_same(_weights(built), reference)


def test_weights_drawn_once_per_parameter(monkeypatch):
    """build_model draws each random parameter once (GPT's seed), not once in GPT() and again afterwards."""
    import arguments

    cfg = arguments.prepare(
        arguments.load_config(
            [
                "--num_layers=2",
                "--hidden_size=32",
                "--num_attention_heads=4",
                "--seq_length=16",
                "--vocab_size=1000",
                "--seed=5",
            ]
        )
    )
    drawn = []
    original = model_module.draw_slice
    monkeypatch.setattr(
        model_module, "draw_slice", lambda out, *a, **k: drawn.append(out) or original(out, *a, **k)
    )
    built = build_model(cfg, torch.device("cpu"))
    random = [p for n, p in built.named_parameters() if p.ndim == 2]
    assert len(drawn) == len(random) and {id(p) for p in drawn} == {id(p) for p in random}


@pytest.mark.parametrize(
    "shape,rows", [((37, 13), 37), ((100, 24), 98), ((7, 1), 7), ((64, 17), 50)]
)
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
                    draw_slice(
                        out, list(shape), tp_dim, rank, draw(3), rows=rows, chunk_numel=chunk
                    )
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
        # a chunk is whole rows, multiples of 16 values
        assert Allocations.largest <= 4096 + 2 * cfg.hidden_size
        for name, p in rank_model.named_parameters():
            tp_dim = getattr(p, "tp_dim", None)
            assert torch.equal(
                p,
                parallel.shard(
                    dict(whole.named_parameters())[name],
                    tp_dim,
                    parallel.Grid(2, 1, world_size=2, rank=rank),
                ),
            ), name


# -----------------------------------------------------------------------------
# The audit: host syncs and collectives, recorded


# What makes the host wait for the device: a value read (item, tolist, float, bool, ...) or a blocking copy out.
HOST_READS = {"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "cpu"}
# What NCCL's all-reduce, broadcast, all-gather and send/recv take (no bool, int16, complex).
NCCL_DTYPES = {
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
}
OBJECT_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
    "all_gather_coalesced",
    "all_reduce_coalesced",
    "monitored_barrier",
) + OBJECT_COLLECTIVES
P2P_OP = dist.P2POp  # torch's (Collectives(run=False) puts a stand-in in its place)


class HostSyncs(TorchFunctionMode):
    """Counts the host syncs on tensors of `device` (the model's), and the tensors built on it from host data
    (torch.tensor(x, device=...): a copy the host waits for). On the meta device, where nothing has a value,
    a read gets a stand-in (ones: a finite loss and grad norm, so the step goes on to the update) and a copy to
    the host leaves the destination as it is; the count is what a GPU would wait for."""

    def __init__(self, device):
        super().__init__()
        self.device, self.syncs = torch.device(device), []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        # host data copied over
        if (
            name in ("tensor", "as_tensor")
            and not isinstance(args[0], torch.Tensor)
            and self.device.type != "cpu"
            and torch.device(kwargs.get("device") or "cpu").type == self.device.type
        ):
            self.syncs.append(name)
        # host.copy_(device tensor)
        if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            if args[0].device.type == "cpu" and args[1].device.type == self.device.type != "cpu":
                if not kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
                    self.syncs.append("copy_")
                return args[0] if self.device.type == "meta" else func(*args, **kwargs)
        if t is None or t.device.type != self.device.type:
            return func(*args, **kwargs)
        if name == "to" or name == "cpu":
            to = {k: v for k, v in kwargs.items() if k != "copy"}
            target, dtype, non_blocking, _ = (
                torch._C._nn._parse_to(*args[1:], **to)
                if name == "to"
                else (torch.device("cpu"), None, False, None)
            )
            if target is None or target.type != "cpu":
                return func(*args, **kwargs)
            if not non_blocking:
                self.syncs.append(name)
            if self.device.type == "meta":
                return torch.ones(t.shape, dtype=dtype or t.dtype)
            return func(*args, **kwargs)
        if name in HOST_READS:
            self.syncs.append(name)
            if self.device.type == "meta":
                stand_in = torch.ones(t.shape, dtype=t.dtype)
                return getattr(stand_in, name)(*args[1:], **kwargs)
        return func(*args, **kwargs)


class Collectives:
    """Every torch.distributed collective and point-to-point call, recorded with its tensors: `with
    Collectives(run=False)` records without communicating (a rank of a layout simulated in one process, its
    groups sentinels), run=True wraps the real calls of a multi-process run. `phase` labels what is recorded
    (train_step sets it to "loop" in the runs below)."""

    def __init__(self, run=True):
        self.run, self.calls, self.phase, self.patched = run, [], "setup", []

    def __enter__(self):
        for name in COLLECTIVES:
            # isend/irecv inside a P2POp must stay torch's own (P2POp checks): batch_isend_irecv records them
            if hasattr(dist, name) and name not in ("isend", "irecv"):
                self.patched.append((name, getattr(dist, name)))
                setattr(dist, name, self._wrap(name, getattr(dist, name)))
        if not self.run:
            self.patched.append(("P2POp", dist.P2POp))
            dist.P2POp = lambda op, tensor, peer, group=None, tag=0: (op, tensor, peer)
        return self

    def __exit__(self, *exc):
        for name, original in reversed(self.patched):
            setattr(dist, name, original)

    def _wrap(self, name, original):
        def call(*args, **kwargs):
            tensors = [t for a in (*args, *kwargs.values()) for t in _tensors(a)]
            self.calls.append((self.phase, name, tensors))
            if self.run:
                return original(*args, **kwargs)
            handle = _Done()
            return (
                [handle] * len(args[0])
                if name == "batch_isend_irecv"
                else handle
                if kwargs.get("async_op")
                else None
            )

        return call

    def problems(self, device):
        """What NCCL would refuse, or what would sync the host inside the training loop."""
        out = []
        for phase, name, tensors in self.calls:
            if name in OBJECT_COLLECTIVES and phase == "loop":
                out.append(
                    f"{name}: an object collective inside the training loop (pickles and syncs the host)"
                )
            for t in tensors:
                if t.device.type != torch.device(device).type:
                    out.append(
                        f"{name} ({phase}): a tensor on {t.device}, not the model's device {device}"
                    )
                if not t.is_contiguous():
                    out.append(f"{name} ({phase}): a non-contiguous tensor")
                if t.dtype not in NCCL_DTYPES:
                    out.append(f"{name} ({phase}): dtype {t.dtype}, which NCCL does not take")
        return out


class _Done:
    def wait(self):
        return True

    def is_completed(self):
        return True


def _tensors(a):
    if isinstance(a, torch.Tensor):
        return [a]
    if isinstance(a, P2P_OP):
        return [a.tensor]
    if isinstance(a, (list, tuple)):
        return [t for x in a for t in _tensors(x)]
    return []


# -----------------------------------------------------------------------------
# One training step with every tensor on the meta device


META_ARGV = [
    "--num_layers=4",
    "--hidden_size=32",
    "--num_attention_heads=4",
    "--seq_length=16",
    "--vocab_size=50257",
    "--micro_batch_size=2",
    "--log_interval=1",
    "--telemetry_interval=1",
    "--spike_guard",
    "--spike_guard_snapshot_interval=1",
    "--exit_signal_handler",
    "--save=none",
    "--save_interval=none",
    "--hidden_dropout=0.1",
    "--attention_dropout=0.1",
]


def _meta_step(monkeypatch, extra, tp=1, pp=1, dp=1, rank=0, micro_batches=2):
    """Build rank `rank` of a TP x PP x DP layout on the meta device, in this process, and run one iteration of
    the loop on it: train_step (forward, backward, reductions, grad norm, zero count, loss scaler, clipping,
    optimizer), telemetry, the spike guard's update and snapshot, the exit signal. Collectives are recorded and
    not run (their groups are sentinels). Returns (the Step, the host syncs, the collectives)."""
    import arguments
    import safety
    from report import LoggingConfig, Report
    from sections import section
    from stability import telemetry

    world = tp * pp * dp
    cfg = arguments.load_config(
        META_ARGV
        + [
            f"--tensor_model_parallel_size={tp}",
            f"--pipeline_model_parallel_size={pp}",
            f"--global_batch_size={2 * micro_batches * dp}",
            *extra,
        ]
    )
    cfg = arguments.prepare(cfg, world)
    grid = parallel.Grid(tp, pp, world_size=world, rank=rank)
    for group in ("tp_group", "dp_group", "pp_group", "mp_group", "embedding_group"):
        setattr(grid, group, group)  # sentinels: Collectives(run=False) communicates nothing
    meta = torch.device("meta")
    monkeypatch.setattr(parallel, "grid", grid)
    # NCCL's: the model's GPU
    monkeypatch.setattr(parallel, "comm_device", lambda backend=None: meta)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    plan = plan_of(cfg, dp)
    with Collectives(run=False) as comms:
        parts = builders.build(cfg, grid, plan, meta)
        assert all(p.is_meta for p in parts.model.parameters())
        recorder = telemetry.Telemetry(parts.model, cfg, parts.optimizer)
        store = snapshots_of(cfg)
        guard = spike_guard_of(cfg)
        report = Report(section(LoggingConfig, cfg), plan, parts.model, cfg.save)
        exit_signal = safety.ExitSignal(True)
        ids = torch.zeros(cfg.micro_batch_size, cfg.seq_length, dtype=torch.int64, device=meta)
        batches = [(ids, ids)] * micro_batches
        syncs = HostSyncs(meta)
        comms.phase = "loop"
        try:
            with syncs:
                recorder.begin()
                step = whole_step(
                    parts.model,
                    parts.optimizer,
                    parts.scaler,
                    batches,
                    1e-4,
                    parts.rules,
                    meta,
                    callbacks=telemetry.Probe(recorder),
                    count_zeros=True,
                )
                recorder.finish()
                guard.update(1, step.outcome, step.loss, step.grad_norm, parts.scaler)
                report.step(step, 1e-4)
                parts.state.advance(
                    cfg.global_batch_size, cfg.seq_length, applied=step.outcome == "ok"
                )
                report.timed(0.1)
                report.log(
                    1, parts.state, cfg.global_batch_size, cfg.seq_length, parts.scaler.scale
                )
                exit_signal()
                in_step = list(syncs.syncs)
                # every spike_guard_snapshot_interval iterations, not each one
                store.maybe_take(1, parts)
        finally:
            exit_signal.restore()
    assert store.items
    return step, in_step, comms


LAYOUTS = {
    "one process": {},
    "TP2": dict(tp=2, rank=1),
    "PP2 first": dict(pp=2, rank=0),
    "PP2 last": dict(pp=2, rank=1),
    "DP2 ZeRO-1": dict(dp=2, rank=1, extra=["--zero_stage=1"]),
    "DP2 z-loss": dict(dp=2, rank=1, extra=["--z_loss=1e-4"]),
}


@pytest.mark.parametrize(
    "layout,precision", [(layout, "--fp16") for layout in LAYOUTS] + [("one process", "--bf16")]
)
def test_train_step_on_meta(monkeypatch, layout, precision):
    """One iteration of the loop with every tensor on the meta device, the stand-in for CUDA here: a meta tensor
    has a device but no data, so an op that mixes it with a CPU tensor raises as it would with a CUDA tensor,
    a tensor made on the CPU by mistake (a missing device=) fails at its first use with the model's, and a read
    of a value would fail if HostSyncs did not count it. Every collective takes tensors on the model's device,
    contiguous, in a dtype NCCL takes; the host syncs are as many with 8 micro-batches as with 2."""
    kw = dict(LAYOUTS[layout])
    extra = kw.pop("extra", []) + [precision]
    step, syncs_2, comms = _meta_step(monkeypatch, extra, **kw, micro_batches=2)
    assert step.outcome == "ok"  # the update ran
    # the log line's z-loss, read in the step's sync
    assert (step.z_loss is not None) == ("--z_loss=1e-4" in extra)
    assert comms.problems("meta") == []
    if kw:  # a layout of several ranks communicates inside the step
        assert any(phase == "loop" for phase, _, _ in comms.calls)
    _, syncs_8, _ = _meta_step(monkeypatch, extra, **kw, micro_batches=8)
    assert syncs_8 == syncs_2
    # one copy of the step's numbers (loss, grad norm, zero count, z-loss), telemetry's two lists (on its iterations
    # only), one read of the exit flag: nothing per micro-batch, nothing per parameter, nothing in the log line
    assert syncs_2 == ["cpu", "tolist", "tolist", "item"]


# -----------------------------------------------------------------------------
# Two gloo processes: every collective of the real runs


def _audited_runs(corpus, layouts):
    """train.py's main for each layout in turn on this rank, every collective recorded; raises what NCCL would refuse
    or what syncs the host inside the loop (the loop: from the first step's backward on)."""
    import contextlib
    import io

    import training

    for layout in layouts:
        with Collectives(run=True) as comms:

            def in_loop(*a, **k):
                comms.phase = "loop"
                return backward(*a, **k)

            training.backward = in_loop  # where train.py looks it up: the step's first call
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    train_script()["main"](
                        [
                            *E2E_ARGS,
                            f"--data_path={corpus}",
                            "--train_iters=3",
                            "--exit_signal_handler",
                            *layout,
                        ]
                    )
            finally:
                training.backward = backward
        assert any(phase == "loop" for phase, _, _ in comms.calls), layout
        # gloo's device and the model's (the meta test checks the device apart)
        problems = comms.problems("cpu")
        assert not problems, f"{layout}: {sorted(set(problems))}"


# TP2, PP2 and DP2 with ZeRO-1 (fp16 on PP2: the loss scaler's path)
NATIVE_LAYOUTS = [
    ["--tensor_model_parallel_size=2", "--telemetry_interval=2"],
    ["--pipeline_model_parallel_size=2", "--fp16"],
    ["--zero_stage=1", "--bf16"],
]


@pytest.mark.slow
def test_collectives_of_two_process_runs(two_ranks):
    """TP2, PP2 and DP2 with ZeRO-1 (fp16 on PP2: the loss scaler's path), 3 iterations each on 2 gloo processes:
    every collective and point-to-point call takes contiguous tensors of a dtype NCCL takes, and no object
    collective happens inside the loop (the exit signal used to all-gather a Python object every iteration)."""
    two_ranks("collectives")


@pytest.mark.slow
def test_collectives_of_a_two_process_deepspeed_run(two_ranks):
    """DeepSpeed ZeRO-1 bf16 on 2 gloo processes: the same audit, DeepSpeed's own collectives included."""
    pytest.importorskip("deepspeed")
    two_ranks("deepspeed")


# -----------------------------------------------------------------------------
# The process group, the CUDA settings, the RNG state: what a GPU run starts with


def test_process_group_binds_the_gpu_and_a_hang_costs_its_timeout(monkeypatch):
    """Under NCCL: LOCAL_RANK's GPU made current and given as device_id (eager communicators on it); the training
    collectives' timeout is the configured one (10 minutes by default: what a hung rank costs), the host work's
    (checkpoint writes, tests/test_checkpoint.py) an hour on a group of its own."""
    import arguments

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda device: calls.append(("set_device", device))
    )
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append(("init", a, k)))
    defaults = arguments.Config()
    parallel.init(
        1,
        1,
        backend="nccl",
        timeout_minutes=defaults.distributed_timeout_minutes,
        host_timeout_minutes=defaults.host_work_timeout_minutes,
    )
    (_, device), (_, args, kwargs) = calls
    assert device == torch.device("cuda", 1) and args == ("nccl",) and kwargs["device_id"] == device
    assert kwargs["timeout"].total_seconds() == 600 and parallel.host_timeout == 60
    calls.clear()
    parallel.init(1, 1, backend="gloo", timeout_minutes=5)
    assert calls == [
        ("init", ("gloo",), {"timeout": datetime.timedelta(minutes=5), "device_id": None})
    ]


def test_cuda_settings(monkeypatch):
    """tf32 (default on) sets the fp32 matmul precision on CUDA, and only there; train.py asks for expandable
    segments unless the user configured the allocator, and never on the CPU."""
    import arguments

    cfg = arguments.prepare(arguments.load_config(["--device=cuda"]))
    assert cfg.tf32
    monkeypatch.setattr(launcher, "get_device", lambda cfg: torch.device("cuda", 0))
    # the CUDA generator: not in this torch
    monkeypatch.setattr(launcher.rng, "seed", lambda seed, device: None)
    previous = torch.get_float32_matmul_precision()
    try:
        launcher.setup(section(LayoutConfig, cfg), cfg.seed)
        assert torch.get_float32_matmul_precision() == "high"
        cfg.tf32 = False
        launcher.setup(section(LayoutConfig, cfg), cfg.seed)
        assert torch.get_float32_matmul_precision() == "highest"
        monkeypatch.setattr(launcher, "get_device", lambda cfg: torch.device("cpu"))
        cfg.tf32 = True
        launcher.setup(section(LayoutConfig, cfg), cfg.seed)
        assert torch.get_float32_matmul_precision() == "highest"  # CPU matmuls untouched
    finally:
        torch.set_float32_matmul_precision(previous)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    launcher.use_expandable_segments(arguments.load_config(["--device=cpu"]))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    launcher.use_expandable_segments(cfg)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    launcher.use_expandable_segments(cfg)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_rng_state_is_the_current_gpus_only(monkeypatch):
    """A checkpoint holds the current CUDA device's generator state, not every visible device's (which ties it to
    CUDA_VISIBLE_DEVICES); an older checkpoint's list gives back the current device's entry."""
    import checkpoint

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a CUDA run's process
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([7], dtype=torch.uint8)
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state)
    )

    def every_device(*args):
        raise AssertionError("every visible device's RNG state")

    monkeypatch.setattr(torch.cuda, "get_rng_state_all", every_device)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", every_device)
    state = checkpoint.rng_state()
    assert torch.equal(state["cuda"], torch.tensor([7], dtype=torch.uint8))
    checkpoint.set_rng_state(state)
    older = dict(state, cuda=[torch.tensor([i], dtype=torch.uint8) for i in range(8)])
    checkpoint.set_rng_state(older)
    assert [int(s) for s in restored] == [7, 1]


def test_a_cpu_run_on_a_machine_with_gpus_never_touches_cuda(monkeypatch):
    """device=cpu where GPUs are visible: seeding, the RNG state of a checkpoint and its restore leave CUDA alone
    (asking for a CUDA generator's state starts a context on GPU 0: every rank's, on one GPU)."""
    import arguments
    import checkpoint
    import rng

    def touched(*args, **kwargs):
        raise AssertionError("CUDA touched by a CPU run")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    # torch.manual_seed's lazy CUDA seeding, dropped after
    monkeypatch.setattr(torch.cuda, "_queued_calls", [])
    for name in ("get_rng_state", "set_rng_state", "current_device", "init"):
        monkeypatch.setattr(torch.cuda, name, touched)
    cfg = arguments.prepare(arguments.load_config(["--device=cpu"]))
    device = launcher.setup(section(LayoutConfig, cfg), cfg.seed)
    assert device == torch.device("cpu") and set(rng.get_states()) == {"cpu"}
    state = checkpoint.rng_state()
    assert state["cuda"] is None
    # a GPU run's checkpoint
    checkpoint.set_rng_state(dict(state, cuda=torch.zeros(16, dtype=torch.uint8)))


def _save_on_two_ranks(directory):
    """A checkpoint written from inside the loop by DP2, audited; then rank 1's write fails and both ranks say why."""
    import errno

    import checkpoint

    g = parallel.grid
    model_state, run = {"w": torch.full((4,), 1.0 + g.rank)}, {"state": {"iteration": 5}}
    with Collectives(run=True) as comms:
        comms.phase = "loop"  # a save at save_interval
        path = checkpoint.save(
            directory, 5, model_state, run, {"rank": g.rank}, write_model_state=g.dp_rank == 0
        )
    assert any(name == "all_gather" for _, name, _ in comms.calls) and comms.problems("cpu") == []
    files = checkpoint.read_manifest(path)["files"]
    assert sorted(files) == sorted(
        os.path.basename(f) for f in checkpoint.layout_files(path, checkpoint.topology())
    )
    for name in files:
        assert checkpoint.check_file(os.path.join(path, name), {"files": files}) is None
    assert checkpoint.load(path)[2] == {"rank": g.rank}
    write_files = checkpoint.write_files

    def fails_on_rank_1(*args, **kwargs):
        if g.rank == 1:
            raise OSError(errno.EACCES, "Permission denied", f"{directory}/rank1")
        return write_files(*args, **kwargs)

    checkpoint.write_files = fails_on_rank_1
    try:
        checkpoint.save(
            directory, 6, model_state, run, {"rank": g.rank}, write_model_state=g.dp_rank == 0
        )
    except ValueError as e:  # on both ranks, rank 1's words
        assert f"failed: Permission denied ({directory}/rank1)" in str(e), e
    else:
        raise AssertionError("the failed save did not raise")
    finally:
        checkpoint.write_files = write_files
    assert checkpoint.latest_dir(directory) == path


def test_a_save_inside_the_loop_shares_its_results_by_tensor_collectives(two_ranks):
    """A save at save_interval is inside the training loop: its barriers (failures, every rank's file sizes and
    CRCs for the manifest) are all-gathers of tensors on the backend's device, never object collectives."""
    two_ranks("save")


def test_bench_starts_as_train_does(monkeypatch, corpus):
    """bench.py goes through train.py's start (the allocator's expandable segments, the process group) and setup
    (seeds, TF32), and its telemetry has the optimizer (the update ratio on the fp32 masters)."""
    import bench
    from stability import telemetry

    calls, Telemetry = [], telemetry.Telemetry
    for name in ("start", "setup"):
        monkeypatch.setattr(
            launcher,
            name,
            lambda *a, name=name, f=getattr(launcher, name): calls.append(name) or f(*a),
        )
    monkeypatch.setattr(telemetry, "Telemetry", lambda *a: calls.append(len(a)) or Telemetry(*a))
    bench.measure(
        [
            "config/tiny.py",
            "--num_layers=1",
            "--hidden_size=32",
            "--num_attention_heads=2",
            "--seq_length=16",
            "--micro_batch_size=2",
            "--global_batch_size=2",
            "--telemetry_interval=2",
            "--bench_steps=2",
            "--bench_warmup=0",
            f"--data_path={corpus}",
        ]
    )
    assert calls == ["start", "setup", 3]


# -----------------------------------------------------------------------------
# Telemetry: the update on the fp32 masters


def test_telemetry_update_ratio_on_fp32_masters():
    """bf16 weights with a small learning rate: most updates are below half a bf16 ulp, so the weights barely
    move while the fp32 masters do. The update/param ratio is the masters' (|m_after - m_before| / |p|)."""
    import arguments
    from stability import telemetry

    cfg = arguments.prepare(
        arguments.load_config(
            [
                "--num_layers=2",
                "--hidden_size=32",
                "--num_attention_heads=4",
                "--seq_length=16",
                "--vocab_size=512",
                "--bf16",
                "--micro_batch_size=2",
                "--global_batch_size=2",
                "--telemetry_interval=1",
                "--hidden_dropout=0",
                "--attention_dropout=0",
            ]
        )
    )
    model = build_model(cfg, torch.device("cpu"))
    optimizer = build_optimizer(cfg, model)
    recorder = telemetry.Telemetry(model, cfg, optimizer)
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    masters = [optimizer.main_param(p) for p in model.parameters()]
    before = [m.detach().clone() for m in masters]
    weights_before = [p.detach().clone() for p in model.parameters()]
    recorder.begin()
    step = whole_step(
        model,
        optimizer,
        optim.scaler_for(cfg),
        [(ids[:, :-1], ids[:, 1:])],
        1e-6,
        builders.step_rules(cfg),
        torch.device("cpu"),
        callbacks=telemetry.Probe(recorder),
    )
    stats = recorder.finish()
    assert step.outcome == "ok"
    update = sum(float((m.detach() - b).double().square().sum()) for m, b in zip(masters, before))
    weights_moved = sum(int((p != b).sum()) for p, b in zip(model.parameters(), weights_before))
    param = sum(float(p.detach().double().square().sum()) for p in model.parameters())
    # per layer, the squares add up: the whole model's ratio from the per-layer ones and norms
    ratios, norms = stats["update/param rms"], stats["param norm"]
    total = sum((r * n) ** 2 for r, n in zip(ratios, norms))
    assert update > 0 and weights_moved < 0.5 * sum(p.numel() for p in model.parameters())
    assert abs(total - update) <= 1e-3 * update and param > 0


def _telemetry_with_and_without_zero():
    import arguments
    from stability import telemetry

    stats = {}
    for zero in (0, 1):
        cfg = arguments.prepare(
            arguments.load_config(
                [
                    "--num_layers=2",
                    "--hidden_size=32",
                    "--num_attention_heads=4",
                    "--seq_length=16",
                    "--vocab_size=512",
                    "--bf16",
                    "--micro_batch_size=2",
                    "--global_batch_size=4",
                    "--hidden_dropout=0",
                    "--attention_dropout=0",
                    f"--zero_stage={zero}",
                ]
            ),
            2,
        )
        model = build_model(cfg, torch.device("cpu"))
        optimizer = build_optimizer(cfg, model)
        recorder = telemetry.Telemetry(model, cfg, optimizer)
        tokens = torch.randint(
            0, 512, (2, 17), generator=torch.Generator().manual_seed(parallel.grid.dp_rank)
        )
        recorder.begin()
        whole_step(
            model,
            optimizer,
            optim.scaler_for(cfg),
            [(tokens[:, :-1], tokens[:, 1:])],
            1e-3,
            builders.step_rules(cfg),
            torch.device("cpu"),
            callbacks=telemetry.Probe(recorder),
        )
        stats[zero] = recorder.finish()["update/param rms"]
    assert all(r > 0 for r in stats[0])
    for a, b in zip(stats[0], stats[1]):
        assert abs(a - b) <= 1e-6 * a, (stats[0], stats[1])


@pytest.mark.slow
def test_telemetry_update_ratio_with_zero1_masters(two_ranks):
    """DP2 with ZeRO-1 (each fp32 master on one DP rank) reports the update/param ratio DP2 without it does."""
    two_ranks("telemetry")


# -----------------------------------------------------------------------------
# test -> its check, in the order they run in one pair of processes (helpers.two_rank_checks): those on the spawn's
# own DP2 grid before train.py's main sets its layouts; DeepSpeed last, so that what its import and engine leave in a
# process is not under the native audit
TWO_RANK_CHECKS = {
    "test_a_save_inside_the_loop_shares_its_results_by_tensor_collectives": "save",
    "test_telemetry_update_ratio_with_zero1_masters": "telemetry",
    "test_collectives_of_two_process_runs": "collectives",
    "test_collectives_of_a_two_process_deepspeed_run": "deepspeed",
}


def _run_check(check, directory, corpus):
    if check == "save":
        _save_on_two_ranks(os.path.join(directory, "save"))
    elif check == "telemetry":
        _telemetry_with_and_without_zero()
    elif check == "collectives":
        _audited_runs(corpus, NATIVE_LAYOUTS)
    else:
        _audited_runs(corpus, [["--deepspeed", "--zero_stage=1", "--bf16"]])


@pytest.fixture(scope="module")
def two_ranks(request, synthetic_corpus, tmp_path_factory):
    import importlib.util

    checks = dict(TWO_RANK_CHECKS)
    if importlib.util.find_spec("deepspeed") is None:
        del checks["test_collectives_of_a_two_process_deepspeed_run"]
    directory = tmp_path_factory.mktemp("two_ranks")
    return two_rank_checks(request, directory, _run_check, checks, synthetic_corpus)


# -----------------------------------------------------------------------------
# On a GPU (python -m pytest -m cuda): what the CPU tests stand in for, checked on the real thing


GPU = [*SMALL, "--device=cuda", "--deterministic"]


@pytest.mark.cuda
def test_gpu_build_has_the_cpu_weights():
    """build_model on the GPU (the construction that used to stop every CUDA run) gives the CPU's weights."""
    import arguments

    cfg = arguments.prepare(
        arguments.load_config(
            [
                "--num_layers=2",
                "--hidden_size=64",
                "--num_attention_heads=4",
                "--seq_length=32",
                "--embed_layernorm",
                "--tensor_model_parallel_size=1",
            ]
        )
    )
    on_cpu = _weights(build_model(cfg, torch.device("cpu")))
    on_gpu = build_model(cfg, torch.device("cuda", torch.cuda.current_device()))
    assert all(p.is_cuda for p in on_gpu.parameters())
    _assert_same({n: t.cpu() for n, t in _weights(on_gpu).items()}, on_cpu)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--fp16"]])
def test_train_on_a_gpu(corpus, precision):
    """python train.py --device=cuda in fp32 (TF32 matmuls), bf16 and fp16: builds, trains 3 iterations, finite
    losses, the log line printed."""
    got = losses(run_cli(*GPU, "--train_iters=3", *precision).stdout)
    assert sorted(got) == [1, 2, 3] and all(
        float(v) == float(v) and float(v) < 20 for v in got.values()
    ), got


@pytest.mark.cuda
def test_resume_on_a_gpu_is_bit_exact(corpus, tmp_path):
    """bf16 on the GPU, deterministic: 6 iterations straight, or 3 then a resume for 3 more, end with the same
    weights, bit for bit (the CUDA generator state of this device is in the checkpoint)."""
    import checkpoint

    straight, split = tmp_path / "straight", tmp_path / "split"
    full = losses(run_cli(*GPU, "--bf16", "--train_iters=6", f"--save={straight}").stdout)
    run_cli(*GPU, "--bf16", "--train_iters=3", f"--save={split}")
    resumed = losses(run_cli(*GPU, "--bf16", "--train_iters=6", f"--save={split}").stdout)
    assert {i: full[i] for i in range(4, 7)} == resumed
    a, b = (
        checkpoint.read(
            checkpoint.model_file(str(d / "global_step6"), parallel.Grid(world_size=1)), "model"
        )
        for d in (straight, split)
    )
    _assert_same(a["model"], b["model"])


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_two_gpus_nccl_tp2_trains_as_one(synthetic_corpus, tmp_path):
    """torchrun with 2 processes on 2 GPUs (NCCL, TP=2) trains the model one GPU trains (full fp32 matmuls)."""
    gpu = [f"--data_path={synthetic_corpus}", "--device=cuda", "--tf32=false"]
    ref = launch(tmp_path / "one", 1, *gpu)
    assert_same_training(
        launch(tmp_path / "tp2", 2, *gpu, "--tensor_model_parallel_size=2"), ref, rel=1e-4
    )


@pytest.mark.parametrize("local_rank,gpus,expected", [(3, 8, 3), (11, 8, 3), (3, 1, 0), (0, 1, 0)])
def test_the_gpu_of_a_process_is_local_rank_modulo_the_visible_gpus(
    monkeypatch, local_rank, gpus, expected
):
    """LOCAL_RANK % torch.cuda.device_count(): 8 GPUs, all visible (torchrun); one per task (SLURM's per-task
    CUDA_VISIBLE_DEVICES, where LOCAL_RANK 3 was 'invalid device ordinal'); torchrun --virtual-local-rank
    (LOCAL_RANK 0 and one visible GPU). The config check lets one visible GPU per task through."""
    import arguments

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(device))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append(k["device_id"]))
    parallel.init(1, 1, backend="nccl")
    assert calls == [torch.device("cuda", expected)] * 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3" if gpus == 1 else "0,1,2,3,4,5,6,7")
    arguments.check_device(arguments.load_config(["--device=cuda"]))  # no error
    if gpus == 1:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # one GPU on the node for 8 processes: refused
        with pytest.raises(ValueError, match="8 processes on this node but 1 GPU"):
            arguments.check_device(arguments.load_config(["--device=cuda"]))


def test_compile_is_on_for_cuda_unless_switched_off():
    """compile=None (the default) resolves in launch.compiles: on with --device=cuda, off on the CPU; given, it
    is what it says (--compile=false turns it off on a GPU, --compile on the CPU)."""
    import arguments

    def compiles(*argv):
        return launcher.compiles(arguments.load_config(list(argv)))

    assert arguments.Config().compile is None
    assert compiles("--device=cuda") and not compiles("--device=cpu")
    assert not compiles("--device=cuda", "--compile=false") and not compiles(
        "--device=cuda", "--compile", "false"
    )
    assert compiles("--device=cpu", "--compile") and compiles("--device=cpu", "--compile=true")


def _flight_recorder(argv):
    import arguments

    cfg = arguments.load_config(argv)
    launcher.use_nccl_flight_recorder(section(LayoutConfig, cfg), cfg.save)


def test_the_nccl_flight_recorder_is_on_for_cuda_unless_the_user_set_it(
    monkeypatch, tmp_path, capsys
):
    """On with several processes, and its dump's place named at the start (a timeout aborts the process before
    Python can say it); a single-GPU run has no collective to record and gets no nccl_trace/ directory."""

    names = (
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    )
    for name in names:
        # set, then deleted: monkeypatch restores only what it saw, and _flight_recorder sets these
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.delenv("RANK", raising=False)
    _flight_recorder(["--device=cpu", f"--save={tmp_path}"])
    assert not set(names) & set(os.environ)  # gloo: nothing to record
    monkeypatch.setenv("WORLD_SIZE", "1")
    _flight_recorder(["--device=cuda", f"--save={tmp_path}"])
    # one GPU: no collective
    assert not set(names) & set(os.environ) and not (tmp_path / "nccl_trace").exists()
    assert "flight recorder" not in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the user's
    _flight_recorder(["--device=cuda", f"--save={tmp_path}"])
    assert (
        os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
        and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    )
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_trace" / "rank_")
    assert (tmp_path / "nccl_trace").is_dir()  # next to the checkpoints, ready for the dump
    assert capsys.readouterr().out == (
        f"NCCL flight recorder: on a collective timeout each rank dumps its last 50 collectives to "
        f"{tmp_path / 'nccl_trace' / 'rank_'}<rank>; `python -m torch.distributed.flight_recorder.fr_trace "
        f"{tmp_path / 'nccl_trace'}` names the rank that did not join\n"
    )
    # the user turned the dump off: nothing to point at
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    _flight_recorder(["--device=cuda", f"--save={tmp_path}"])
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    monkeypatch.setenv("RANK", "1")  # said once, by rank 0
    _flight_recorder(["--device=cuda", f"--save={tmp_path}"])
    assert capsys.readouterr().out == ""
