"""Where a process starts: its process group, its device, the determinism and seeds of its streams, and how it
ends (a one-line error, the process groups torn down last). train.py and bench.py start the same way.

Not here: the config (arguments.py), what is built on the device (model.py, optim.py, loader.py).
Each function takes the layout's section of the config (layout_cfg: parallel.LayoutConfig) and the
other owners' values it needs.
"""

import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import parallel
import rng


def world_size(default=1):
    """The number of processes the launcher started (torchrun's WORLD_SIZE; `default` without a launcher): known
    before the process group exists, so that the config is checked first."""
    value = os.environ.get("WORLD_SIZE", str(default))
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(
            f"WORLD_SIZE={value!r} must be a positive integer: torchrun sets it (for --dry_run of a cluster's "
            "layout set it by hand, e.g. WORLD_SIZE=256)"
        )
    return int(value)


def check_launcher():
    """A WORLD_SIZE or RANK a launcher did not set (WORLD_SIZE set by hand, as --dry_run takes it, or left in
    the shell): torch's rendezvous failed naming MASTER_ADDR, and a stray RANK=1 silenced every error line
    (exit_with prints rank 0's)."""
    n, rank = world_size(), os.environ.get("RANK", "0")
    missing = [key for key in ("RANK", "MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if n > 1 and missing:
        raise ValueError(
            f"WORLD_SIZE={n} but {', '.join(missing)} unset: no launcher started this process; run "
            f"`torchrun --nproc_per_node {n} train.py ...` (SLURM: srun ... torchrun ...), or unset WORLD_SIZE "
            "for one process"
        )
    if not (rank.isdigit() and int(rank) < n):
        raise ValueError(
            f"RANK={rank!r} is no rank of WORLD_SIZE={n}: the launcher sets both; unset RANK for one process"
        )


def start(layout_cfg, tensor_model_parallel_size, save=None):
    """The process group, CUDA's allocator configured before it starts. tensor_model_parallel_size:
    the model's; save: checkpointing's directory (where NCCL's flight recorder dumps)."""
    check_launcher()
    use_expandable_segments(layout_cfg)
    use_nccl_flight_recorder(layout_cfg, save)
    return parallel.init(
        tensor_model_parallel_size,
        layout_cfg.pipeline_model_parallel_size,
        backend="nccl" if use_cuda(layout_cfg) else "gloo",
        timeout_minutes=layout_cfg.distributed_timeout_minutes,
        host_timeout_minutes=layout_cfg.host_work_timeout_minutes,
    )


def setup(layout_cfg, seed):
    """Determinism, the device and its matmul precision, and the seeds (the data's seed) of this TP
    rank and pipeline stage."""
    set_deterministic(layout_cfg)
    device = get_device(layout_cfg)
    rng.seed(seed, device)  # the dropout streams of this TP rank and pipeline stage (lesson 22)
    np.random.seed(seed)
    if device.type == "cuda":
        # tf32: fp32 matmuls on the tensor cores with a 10-bit mantissa (8x the throughput on A100/H100), as
        # Megatron's users run them; only fp32 runs are affected (bf16/fp16 weights multiply in their dtype).
        torch.set_float32_matmul_precision("high" if layout_cfg.tf32 else "highest")
    return device


def compiles(layout_cfg):
    """Whether the run torch.compiles (config compile; None: on CUDA, where fused kernels pay for themselves in
    the first steps, off on the CPU, where compiling costs minutes at start). The one place that decides it."""
    return use_cuda(layout_cfg) if layout_cfg.compile is None else layout_cfg.compile


def use_cuda(layout_cfg):
    device = layout_cfg.device
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def use_expandable_segments(layout_cfg):
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user set an allocator config: the curriculum
    and ALiBi change the activations' shapes from step to step, which fragments the caching allocator's fixed
    segments (out of memory with memory free). Read by CUDA's allocator when it starts: call before any CUDA
    work."""
    given = {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(os.environ)
    if use_cuda(layout_cfg) and not given:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def use_nccl_flight_recorder(layout_cfg, save=None):
    """On CUDA, unless the user set them: NCCL's flight recorder keeps each rank's last 2000 collectives and, when
    one times out (a hang), dumps them to <save>/nccl_trace/rank_N (torch's TORCH_NCCL_* names), which
    `python -m torch.distributed.flight_recorder.fr_trace` reads to name the rank that did not join; rank 0 says
    where at the start (the watchdog aborts the process on a timeout before Python could say it). Read when the
    process group starts: call before it. One process has no collective to hang in: nothing is set or made."""
    if not use_cuda(layout_cfg) or world_size() == 1:
        return
    directory = os.path.abspath(os.path.join(save or ".", "nccl_trace"))
    defaults = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(directory, "rank_"),
    }
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in os.environ:
        os.makedirs(directory, exist_ok=True)
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    entries, prefix = (
        os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"],
        os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"],
    )
    on = entries.strip() not in ("", "0") and os.environ[
        "TORCH_NCCL_DUMP_ON_TIMEOUT"
    ].strip().lower() not in ("", "0", "false", "no", "n", "off")
    # the one place a hang's evidence is named before it happens
    if on and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"NCCL flight recorder: on a collective timeout each rank dumps its last {entries} collectives to "
            f"{prefix}<rank>; `python -m torch.distributed.flight_recorder.fr_trace {os.path.dirname(prefix)}` "
            "names the rank that did not join",
            flush=True,
        )


def set_deterministic(layout_cfg):
    """deterministic=True: the same bits from the same run, whatever the load of the machine. On CPU the matrix
    products are MKL's, whose default code path depends on the number of threads MKL decides to use (1 and 2
    threads give different gradient bits); MKL_CBWR=AUTO,STRICT makes them independent of it. MKL reads it at its
    first call, which train.py makes after this point. torch's own reductions still split by the thread count
    torch starts with: same machine shape, same bits. On CUDA: deterministic cuBLAS workspaces and kernels."""
    if not layout_cfg.deterministic:
        return
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def get_device(layout_cfg):
    """The model's device, which is also the backend's communication device (NCCL for CUDA, gloo for CPU)."""
    if use_cuda(layout_cfg):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


EXIT_GRACE_SECONDS = 5  # how long a rank other than 0 waits, after an error, before it exits


def exit_with(error, code):
    """Stop on a configuration or input error: one clear line, no traceback. Every rank has it (the config is
    everyone's) or some do (a file): rank 0 prints it, and each rank that has it leaves it in torchrun's error file,
    so that the launcher's summary names it as the root cause instead of 'To enable traceback see ...'."""
    line = f"error: {error}"
    # torchrun's rank (the process group may not exist yet); a process alone prints whatever RANK says
    try:
        launched = world_size() > 1
    except ValueError:  # a WORLD_SIZE that is no count: the error being said may be that one
        launched = False
    rank = os.environ.get("RANK", "0")
    rank = int(rank) if launched and rank.isdigit() else 0
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:  # torch.distributed.elastic's format
            json.dump(
                {
                    "message": {
                        "message": f"{type(error).__name__}: {error}",
                        "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
                    }
                },
                f,
            )
    if rank != 0:
        # torchrun stops every rank at the first exit: a rank that left first had rank 0, which has a config's
        # error too, killed before it printed it (seen in a CI run on a loaded machine); this one waits for it
        time.sleep(EXIT_GRACE_SECONDS)
    sys.exit(code)


def shut_down(finished):
    """The process groups last (the prefetch thread, the checkpoint writer and DeepSpeed are done by then), after a
    barrier when the run finished: no rank tears its connections down while another still talks to it (a
    DeepSpeed bf16 PP=2 run that had saved aborted at exit on one rank, 'terminate called without an active
    exception', in 1 of 5 runs, and torchrun called the job failed). After an error there is no barrier: the
    other ranks may be gone."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
