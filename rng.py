"""Megatron's random streams for dropout under tensor and pipeline parallelism (lesson 22).

Each rank draws dropout masks from two streams:
- the default stream (torch's global generators), seeded with seed + 100 * pipeline stage: the same on every TP
  rank of a stage, so that dropout on activations every TP rank holds whole (the hidden states after attention
  and MLP, the embeddings) draws the same mask everywhere and the replicas stay identical;
- the model-parallel stream, seeded with seed + 100 * stage + 2718 + TP rank: a different one on every TP rank,
  for dropout on activations split across TP ranks (the attention probabilities of this rank's heads), so that
  the heads of different ranks do not share masks.
This is Megatron-LM's _set_random_seed and model_parallel_cuda_manual_seed. The model-parallel stream is kept as a
generator state and swapped in around the code that uses it (fork), because dropout takes no generator argument.

Activation checkpointing recomputes a layer's forward during backward: torch.utils.checkpoint restores the
default stream's state for that, and checkpoint() below restores the model-parallel stream's as well (as
Megatron's CheckpointFunction does), so the recomputed masks are the forward's. Both streams are saved in
checkpoints (checkpoint.rng_state), so a resumed run draws the masks an uninterrupted one would.
"""

import contextlib

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

import parallel

PIPELINE_SEED_STRIDE = 100  # Megatron: seed + 100 * pipeline rank
MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron: + 2718 + tensor-parallel rank

# The model-parallel stream: {device type: generator state}, or None until seed() is called (a model used
# outside train.py, e.g. in a unit test, then draws everything from the default stream, like any nn.Module).
_states = None


def _generator_state(device_type):
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_generator_state(device_type, state):
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def cuda_state():
    """The current CUDA device's default generator state; None in a process that has not used CUDA (a CPU run,
    even on a machine with GPUs: asking would start a CUDA context on GPU 0). This rank's own GPU only: every
    visible device's (get_rng_state_all) would tie a checkpoint to how many GPUs the process sees, and a resume
    with another CUDA_VISIBLE_DEVICES would fail on the count or put a state on a device that never used it."""
    return torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None


def set_cuda_state(state):
    """Put cuda_state()'s state back into the current device (not in a process that has not used CUDA). A list,
    every visible device's state (checkpoints written before), gives the current device's entry: the one this
    rank drew from under torchrun."""
    if state is None or not torch.cuda.is_initialized():
        return
    if isinstance(state, (list, tuple)):
        state = state[min(torch.cuda.current_device(), len(state) - 1)]
    torch.cuda.set_rng_state(state)


def seed(seed, device="cpu"):
    """Seed this rank's two streams (after parallel.init, which fixes the TP and pipeline ranks) on the run's
    device: the CPU's, and a CUDA device's only when the run is on one (torch.manual_seed seeds CUDA lazily)."""
    global _states
    g = parallel.grid
    stage_seed = seed + PIPELINE_SEED_STRIDE * g.pp_rank
    # CPU and every CUDA device
    torch.manual_seed(stage_seed + MODEL_PARALLEL_SEED_OFFSET + g.tp_rank)
    _states = {"cpu": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        _states["cuda"] = torch.cuda.get_rng_state()
    torch.manual_seed(stage_seed)


def get_states():
    """A copy of the model-parallel stream's state (None when not seeded): for checkpoints and recomputation."""
    return None if _states is None else {k: v.clone() for k, v in _states.items()}


def set_states(states):
    global _states
    _states = None if states is None else {k: v.clone() for k, v in states.items()}


@contextlib.contextmanager
def fork(device):
    """Run the block with the model-parallel stream as `device`'s default generator, then put the default back.
    No host sync: a CUDA generator state is a seed and an offset kept on the host."""
    if _states is None:
        yield
        return
    kind = torch.device(device).type
    default = _generator_state(kind)
    _set_generator_state(kind, _states[kind])
    try:
        yield
    finally:
        _states[kind] = _generator_state(kind)
        _set_generator_state(kind, default)


@contextlib.contextmanager
def _restored(states):
    """The model-parallel stream at `states` inside the block, and where it was again after it."""
    current = get_states()
    set_states(states)
    try:
        yield
    finally:
        set_states(current)


def checkpoint(function, *args):
    """function(*args) with its activations recomputed in backward (torch's non-reentrant checkpoint, which
    replays the default stream), replaying the model-parallel stream from its state at the forward too."""

    def contexts():  # called at the forward: the state to replay is the one of this moment
        return contextlib.nullcontext(), _restored(get_states())

    return _torch_checkpoint(function, *args, use_reentrant=False, context_fn=contexts)
