"""Parallel training as it runs at scale: NCCL-ready collectives, Megatron's dropout streams under TP and
activation checkpointing, the TP replica check (lesson 18), a model that does not depend on the vocabulary padding
(hence on the TP size), and uneven pipeline stages (BLOOM-176B's 70 layers on 12 stages).

Unit level: a fake NCCL backend for the choice of device, DeepSpeed's partition_balanced for the partition, two
gloo processes for the streams and the replica check. End to end (train.py under torchrun, as test_parallel.py):
TP=2 with GPT-2's vocabulary and 3 layers on PP=2 against one process, TP=2 with dropout and checkpointing resumed.
"""

import math
import os
import re
import subprocess

import pytest
import torch
import torch.distributed as dist

import parallel
import rng
import safety
from helpers import (  # noqa: F401
    ROOT,
    TINY,
    assert_replicas_identical,
    assert_same_training,
    dumps,
    gather,
    launch,
    launch_once,
    spawn,
    stage,
    synthetic_corpus,  # (synthetic_corpus: a fixture)
    torchrun,
)

# -----------------------------------------------------------------------------
# Collectives take tensors on the backend's device


def test_comm_device_follows_the_backend(monkeypatch):
    assert parallel.comm_device() == torch.device("cpu")  # no process group
    assert parallel.comm_device("gloo") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert parallel.comm_device("nccl") == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert parallel.comm_device() == torch.device("cuda", 3)


def test_scalar_collectives_use_the_comm_device(monkeypatch):
    """The scalars every rank must agree on (safety.minutes_since: exit_duration_in_mins) travel on
    the communication device; a CPU tensor there raises under NCCL. 'meta' stands in for the GPU."""
    seen = []

    class Sent(Exception):
        pass

    def collective(tensor, *args, **kwargs):
        seen.append(tensor.device)
        raise Sent

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel, "comm_device", lambda backend=None: torch.device("meta"))
    monkeypatch.setattr(dist, "broadcast", collective)
    monkeypatch.setattr(dist, "all_reduce", collective)
    for call in (lambda: safety.minutes_since(0.0), lambda: parallel.broadcast_scalars([1.0])):
        with pytest.raises(Sent):
            call()
    assert seen == [torch.device("meta")] * 2


# -----------------------------------------------------------------------------
# Uneven pipeline stages


def test_partition_layers_is_deepspeeds_balanced_partition():
    from deepspeed.runtime.utils import partition_balanced

    # BLOOM-176B: 70 layers + embedding + head = 72 = 12 x 6
    bloom = parallel.partition_layers(70, 12)
    assert [len(r) for r in bloom] == [5] + [6] * 10 + [5]
    assert [len(r) for r in parallel.partition_layers(70, 12, "type:transformer")] == [6] * 10 + [
        5
    ] * 2
    for layers in range(1, 13):
        for pp in range(1, layers + 4):
            for method, ends in (("type:transformer|embedding", 1), ("type:transformer", 0)):
                if pp > layers + 2 * ends:
                    with pytest.raises(ValueError, match="too small"):
                        parallel.partition_layers(layers, pp, method)
                    continue
                ranges = parallel.partition_layers(layers, pp, method)
                assert (
                    [r.step for r in ranges] == [1] * pp
                    and ranges[0].start == 0
                    and ranges[-1].stop == layers
                )
                assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
                # DeepSpeed's partition of the units (embedding, layers..., head), each of weight 1
                bounds = partition_balanced([1] * (layers + 2 * ends), pp)
                units = [b - a for a, b in zip(bounds, bounds[1:])]
                assert [
                    len(r) + ends * ((s == 0) + (s == pp - 1)) for s, r in enumerate(ranges)
                ] == units
    with pytest.raises(ValueError, match="pp_partition_method"):
        parallel.partition_layers(4, 2, "parameters")


def test_dry_run_of_bloom_layers_on_twelve_stages():
    import io
    import os

    import arguments
    import estimate

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = arguments.load_config(
        [
            os.path.join(root, "config/tr8b_104b.py"),
            "--num_layers=70",
            "--pipeline_model_parallel_size=12",
            "--pp_partition_method=type:transformer|embedding",
        ]
    )
    out = io.StringIO()
    estimate.dry_run(cfg, world_size=384, file=out)
    rows = [
        line.split()[:2]
        for line in out.getvalue().splitlines()
        if line.split()[:1] in (["0"], ["1-10"], ["11"])
    ]
    assert rows == [["0", "5"], ["1-10", "6"], ["11", "5"]]
    # 6 layers x 11 in flight > 5 x 12 on stage 0
    assert "activations on stage 1 " in out.getvalue()


# -----------------------------------------------------------------------------
# Dropout streams and the TP replica check on two gloo processes (TP=2)


def _streams_and_replicas():
    import optim
    from model import GPTConfig

    g = parallel.grid
    try:
        # the default stream is the same on both TP ranks, the model-parallel stream is not
        rng.seed(1234)
        with rng.fork("cpu"):
            split = torch.rand(8)
        shared = torch.rand(8)
        a, b = gather(split, g.tp_group)
        assert not torch.equal(a, b)
        a, b = gather(shared, g.tp_group)
        assert torch.equal(a, b)
        torch.manual_seed(1234 + 100 * g.pp_rank)  # forking left the default stream where it was
        assert torch.equal(torch.rand(8), shared)

        # dropout on, TP=2: activation checkpointing changes nothing (both streams replayed in the recomputation),
        # and the replicated parameters get the same gradient on both TP ranks
        results = []
        for checkpointing in (False, True):
            cfg = GPTConfig(
                **{
                    **TINY,
                    "hidden_dropout": 0.2,
                    "attention_dropout": 0.2,
                    "checkpoint_activations": checkpointing,
                }
            )
            model = stage(cfg).train()
            x, y = torch.randint(
                0, cfg.vocab_size, (2, 2, 16), generator=torch.Generator().manual_seed(0)
            )
            rng.seed(1234)
            for _ in range(2):  # two micro-batches: the streams move on between them
                model(x, y).backward()
            results.append(model)
        for (name, p), q in zip(results[0].named_parameters(), results[1].parameters()):
            assert torch.equal(p.grad, q.grad), name
            if getattr(p, "tp_dim", None) is None:
                a, b = gather(p.grad, g.tp_group)
                assert torch.equal(a, b), name

        # the replica check: clean, then one rank's LayerNorm gain drifts (lesson 18), then re-synced
        model = results[0]
        optimizer = optim.build_optimizer(model, 1e-3, 0.1, 0.9, 0.95, 1e-8)
        optimizer.step()
        assert parallel.check_tp_replicas(model) == (0.0, [])
        ln = model.blocks["1"].ln_1.weight
        if g.tp_rank == 1:
            with torch.no_grad():
                ln[3] += 1e-3
                optimizer.state[ln]["exp_avg"][3] += 1.0
        worst, differ = parallel.check_tp_replicas(model)
        assert math.isclose(worst, 1e-3, rel_tol=1e-3)
        assert [name for name, _ in differ] == (["blocks.1.ln_1.weight"] if g.tp_rank == 1 else [])
        worst, _ = parallel.check_tp_replicas(model, resync=True, optimizer=optimizer)
        assert math.isclose(worst, 1e-3, rel_tol=1e-3)
        assert parallel.check_tp_replicas(model) == (0.0, [])
        for t in (ln, optimizer.state[ln]["exp_avg"]):
            a, b = gather(t.detach(), g.tp_group)
            assert torch.equal(a, b)
    finally:
        rng.set_states(None)


def test_replica_resync_copies_all_of_an_8bit_adam_state(monkeypatch):
    """tp_replica_resync with bitsandbytes' 8-bit AdamW: a replicated weight of 4096 elements or more (any
    LayerNorm of a large model) has its moments as uint8 codes (state1, state2) and one scale per block (absmax1,
    absmax2); TP rank 1 must get TP rank 0's codes and scales together, or its moments are neither rank's. The
    two TP ranks in one process: rank 0's broadcasts are recorded, then replayed into rank 1's check."""
    pytest.importorskip("bitsandbytes")
    import optim
    import precision

    def rank(gain, grad):
        model = torch.nn.Module()
        model.ln = torch.nn.Parameter(torch.full((8192,), gain))  # replicated: no tp_dim
        model.ln.grad = grad
        # 32-bit state for tensors below 4096 elements only
        opt = precision.MixedPrecisionOptimizer(
            optim.build_optimizer(model, 1e-3, 0.0, 0.9, 0.95, 1e-8, use_bnb_optimizer=True)
        )
        opt.step()
        return model, opt

    gen = torch.Generator().manual_seed(0)
    zero = rank(1.0, torch.randn(8192, generator=gen))
    one = rank(1.001, 100 * torch.randn(8192, generator=gen))  # drifted, other moments
    assert not torch.equal(zero[1].state[zero[0].ln]["absmax1"], one[1].state[one[0].ln]["absmax1"])
    sent = []
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group=None: sent.append(t.clone()))
    monkeypatch.setattr(parallel, "grid", parallel.Grid(2, 1, world_size=2, rank=0))
    parallel.check_tp_replicas(zero[0], resync=True, optimizer=zero[1])
    received = iter(sent)
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group=None: t.copy_(next(received)))
    monkeypatch.setattr(parallel, "grid", parallel.Grid(2, 1, world_size=2, rank=1))
    parallel.check_tp_replicas(one[0], resync=True, optimizer=one[1])
    assert torch.equal(one[0].ln, zero[0].ln)
    mine, reference = one[1].state[one[0].ln], zero[1].state[zero[0].ln]
    assert mine.keys() == reference.keys()
    differ = [
        k for k, t in reference.items() if not torch.equal(*map(torch.as_tensor, (mine[k], t)))
    ]
    assert differ == []


@pytest.mark.parametrize("rank", range(4))
def test_dropout_stream_seeds_are_megatrons(rank, monkeypatch):
    """Rank `rank` of TP=2 x PP=2 (a grid on paper): the default stream is seeded with seed + 100 x stage, the
    same on both TP ranks; the model-parallel stream with seed + 100 x stage + 2718 + TP rank (lesson 22)."""
    monkeypatch.setattr(parallel, "grid", parallel.Grid(2, 2, world_size=4, rank=rank))
    g = parallel.grid
    try:
        rng.seed(1234)
        default, model_parallel = torch.get_rng_state(), rng.get_states()["cpu"]
    finally:
        rng.set_states(None)
    assert torch.equal(default, torch.manual_seed(1234 + 100 * g.pp_rank).get_state())
    assert torch.equal(
        model_parallel, torch.manual_seed(1234 + 100 * g.pp_rank + 2718 + g.tp_rank).get_state()
    )


@pytest.mark.slow
def test_dropout_streams_checkpointing_and_replica_check_tp2():
    spawn(_streams_and_replicas, 2, 2, 1)


# -----------------------------------------------------------------------------
# End to end through train.py


@pytest.mark.slow
def test_tp2_with_gpt2_vocabulary_matches_one_process(synthetic_corpus, tmp_path, tmp_path_factory):
    # 50257 is padded to 50304 by one process and to 50432 by TP=2: the same model all the same (the one-process
    # run is test_parallel.py's fp32 reference for the half-precision layouts: launched once per session)
    gpt2 = [f"--data_path={synthetic_corpus}", "--vocab_size=50257"]
    one = launch_once(tmp_path_factory, 1, *gpt2)
    assert "padded to 50304" in one.out
    tp2 = launch(tmp_path / "tp2", 2, *gpt2, "--tensor_model_parallel_size=2")
    assert "padded to 50432" in tp2.out
    assert_same_training(tp2, one, rel=1e-5)
    # the README's figure: the lm loss agrees to 2e-7 (relative; 1.0e-7 measured) at every one of the 10 iterations
    worst = max(
        abs(tp2.scalars[it]["lm-loss"] / one.scalars[it]["lm-loss"] - 1) for it in one.scalars
    )
    print(
        f"TP=2 against one process, GPT-2 vocabulary: largest relative lm loss difference {worst:.1e}"
    )
    assert worst <= 2e-7, worst


@pytest.mark.slow
def test_three_layers_on_two_stages_match_one_process_and_resume(synthetic_corpus, tmp_path):
    three = [f"--data_path={synthetic_corpus}", "--num_layers=3"]
    one = launch(tmp_path / "one", 1, *three)
    ckpt = tmp_path / "ckpt"
    layout = [*three, "--pipeline_model_parallel_size=2", f"--save={ckpt}"]
    full = launch(tmp_path / "full", 2, *layout, "--save_interval=5")
    assert (
        "pipeline stages (type:transformer|embedding): 0: embedding + layers 0-1 | 1: layer 2 + head"
        in full.out
    )
    assert_same_training(full, one, rel=1e-5)
    resumed = launch(tmp_path / "resumed", 2, *layout, f"--load={rewind(ckpt, 5)}")
    for it in range(6, 11):  # bit-exact
        assert resumed.scalars[it] == full.scalars[it], it


@pytest.mark.slow
def test_tp2_dropout_with_checkpointing_keeps_replicas_and_resumes_exactly(
    synthetic_corpus, tmp_path
):
    layout = [
        f"--data_path={synthetic_corpus}",
        "--tensor_model_parallel_size=2",
        "--hidden_dropout=0.1",
        "--attention_dropout=0.1",
        "--checkpoint_activations",
        "--tp_replica_check_interval=5",
        "--dump_weights",
    ]
    ckpt = tmp_path / "ckpt"
    full = launch(tmp_path / "full", 2, *layout, f"--save={ckpt}", "--save_interval=5")
    assert full.out.count("max abs difference from TP rank 0: 0.000e+00") == 2
    assert_replicas_identical(dumps(ckpt, 10))
    resumed = launch(tmp_path / "resumed", 2, *layout, f"--load={rewind(ckpt, 5)}")
    for it in range(6, 11):  # both dropout streams come back from the checkpoint
        assert resumed.scalars[it] == full.scalars[it], it


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, layout, message",
    [
        (
            3,
            ["--tensor_model_parallel_size=2"],
            "world size 3 is not divisible by tensor_model_parallel_size (2) x "
            "pipeline_model_parallel_size (1); launch a multiple of 2 processes",
        ),
        (
            2,
            ["--tensor_model_parallel_size=2", "--num_attention_heads=3", "--hidden_size=48"],
            "num_attention_heads (3) must be divisible by tensor_model_parallel_size (2)",
        ),
        (
            2,
            [
                "--pipeline_model_parallel_size=2",
                "--num_layers=1",
                "--pp_partition_method=type:transformer",
            ],
            "num_layers (1) is too small for pipeline_model_parallel_size (2)",
        ),
    ],
    ids=["world-size", "heads", "stages"],
)
def test_layout_errors_under_torchrun_are_one_line_and_exit_2(nproc, layout, message, tmp_path):
    cmd = [
        *torchrun(nproc),
        "train.py",
        "--train_iters=1",
        f"--save={tmp_path / 'ckpt'}",
        *layout,
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"),
    )
    # rank 0's line, or the one torchrun's summary copies from a rank's error file: a rank that fails first
    # has torchrun stop the others, rank 0 too, at times before it prints
    errors = [
        m.group(1) for m in re.finditer(r"^(?:\s*traceback\s*: )?(error: .*)$", proc.stderr, re.M)
    ]
    assert errors and all(line.startswith(f"error: {message}") for line in errors), proc.stderr[
        -3000:
    ]
    # no traceback of ours
    assert "exitcode  : 2" in proc.stderr and 'train.py", line' not in proc.stderr
    assert not (tmp_path / "ckpt").exists()  # stopped before anything was written


def rewind(directory, iteration):
    """Point `latest` at an earlier checkpoint of a finished run (to resume from there)."""
    (directory / "latest").write_text(f"global_step{iteration}\n")
    return directory
