"""The spike guard's snapshots: how far back they reach, the host copies, on a local disk, and their host memory
(the dry run's line, the start's refusal)."""

import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

import arguments
import checkpoint
import parallel
import training

# corpus, corpus512: fixtures
from helpers import (  # noqa: F401
    corpus,
    corpus512,
    log_fields,
    run_main,
    snapshots_of,
    spawn,
    spike_guard_of,
)
from stability import snapshot_plan as plan
from stability import snapshots
from stability.detector import LEARNT

SCALER = types.SimpleNamespace(dynamic=False, scale=1.0, min_scale=1.0)


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_snapshots_reach_back_two_rewinds_and_an_interval(monkeypatch, tmp_path, where):
    """Strikes of text learnt by heart at 1049, 1100 and 1149 (rewind 100, a snapshot every 50, no save) roll back
    to before 949. On disk: one file per snapshot kept, the dropped ones deleted, none left at the end."""
    cfg = arguments.load_config(
        [
            "--spike_guard",
            "--spike_guard_window=16",
            "--spike_guard_min_steps=8",
            "--spike_guard_rewind=100",
            "--spike_guard_snapshot_interval=50",
            "--spike_guard_max_skips=3",
        ]
        + ([f"--spike_guard_snapshot_dir={tmp_path}"] if where == "disk" else [])
    )
    guard = spike_guard_of(cfg)
    assert snapshots.keep(plan(cfg)) == 5
    monkeypatch.setattr(snapshots.run_state, "capture", lambda parts: {"iteration": parts})
    store = snapshots_of(cfg)
    decision = None
    for it in range(1, 1150):
        # text learnt by heart, diagnosed data: the one data spike that rolls back (issue #50)
        if it in (1049, 1100, 1149):
            guard.pending = f"loss 2 is 0.6x an unseen batch's 3.3: {LEARNT}"
            data = {"cause": "data", "evidence": "e"}
            decision = guard.update(it, "vetoed", 2.0, 1.0, SCALER, data)
        store.maybe_take(it, it)
    assert decision["action"] == "rollback" and decision["start"] == 949
    assert [it for it, *_ in store.items] == [900, 950, 1000, 1050, 1100]
    found, payload = store.newest_before(decision["start"])
    assert found == 900 and payload == {"iteration": 900}
    files = sorted(n for n in os.listdir(tmp_path) if n.endswith(".pt"))  # not the rank's lock
    if where == "disk":
        assert files == sorted(
            f"snapshot-rank00000-iteration{it}.pt" for it in (900, 950, 1000, 1050, 1100)
        )
    # what the rollback to it does: the later ones are of another timeline
    store.drop(lambda it: it > found)
    assert [it for it, *_ in store.items] == [900]
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".pt")]) == (
        1 if where == "disk" else 0
    )
    store.close()
    assert os.listdir(tmp_path) == []


def test_a_snapshot_that_cannot_be_written_stops_the_run_naming_the_directory(
    monkeypatch, tmp_path
):
    import errno

    cfg = arguments.load_config(
        [
            "--spike_guard",
            "--spike_guard_snapshot_interval=5",
            f"--spike_guard_snapshot_dir={tmp_path}",
        ]
    )
    monkeypatch.setattr(snapshots.run_state, "capture", lambda parts: {"iteration": parts})

    def full_disk(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    store = snapshots_of(cfg)
    store.maybe_take(5, 5)  # written in the background: its failure is said at the next snapshot
    with pytest.raises(
        ValueError,
        match=f"written to spike_guard_snapshot_dir {tmp_path} .*No space left on device",
    ):
        store.maybe_take(10, 10)


def test_two_runs_given_one_snapshot_directory_do_not_delete_each_others_snapshots(
    monkeypatch, tmp_path
):
    """The second run deleted the first's snapshot files at its start, as a crashed run's leftovers: the first
    died at its next rollback's read (and the names, rank and iteration only, would restore the other's
    weights). Each rank's files are locked; a crashed run's lock (its process gone) is taken over."""
    cfg = arguments.load_config(
        [
            "--spike_guard",
            "--spike_guard_snapshot_interval=5",
            f"--spike_guard_snapshot_dir={tmp_path}",
        ]
    )
    monkeypatch.setattr(snapshots.run_state, "capture", lambda parts: {"iteration": parts})
    first = snapshots_of(cfg)
    first.maybe_take(5, 5)
    first.wait()
    with pytest.raises(
        ValueError,
        match=(
            f"spike_guard_snapshot_dir directory {tmp_path} is in use by another run .*snapshot-rank00000.lock"
        ),
    ):
        snapshots_of(cfg)
    assert torch.load(first.path(5))["iteration"] == 5
    first.close()
    assert os.listdir(tmp_path) == []
    second = snapshots_of(cfg)  # after the first's end
    second.close()


def test_host_copy_is_a_copy_into_the_buffers_given():
    live = {
        "w": torch.ones(3),
        "opt": [torch.zeros(2, 2), 5],
        "rng": (1, 2),
        "history": [[2.5, 2.4], [0.5]],
    }
    buffers = {}
    copy, event = checkpoint.host_copy(live, buffers)
    assert (
        event is None
        and torch.equal(copy["w"], live["w"])
        and copy["opt"][1] == 5
        and copy["rng"] == (1, 2)
    )
    live["w"].add_(1)
    live["history"][0].append(2.3)
    # not aliased
    assert copy["w"].tolist() == [1.0, 1.0, 1.0] and copy["history"] == [[2.5, 2.4], [0.5]]
    # the next snapshot into the dropped one's buffers
    again, _ = checkpoint.host_copy(live, buffers)
    assert again["w"].data_ptr() == copy["w"].data_ptr() and again["w"].tolist() == [2.0, 2.0, 2.0]


@pytest.mark.cuda
def test_host_copy_of_cuda_tensors_is_pinned_non_blocking_and_reuses_the_spare():
    live = {"w": torch.randn(1024, 1024, device="cuda"), "step": torch.tensor(3.0)}
    buffers = {}
    first, event = checkpoint.host_copy(live, buffers)
    event.synchronize()
    assert first["w"].is_pinned() and torch.equal(first["w"], live["w"].cpu())
    buffer = first["w"].data_ptr()
    live["w"].mul_(2)
    second, event = checkpoint.host_copy(live, buffers)
    event.synchronize()
    assert second["w"].data_ptr() == buffer and torch.equal(second["w"], live["w"].cpu())


@pytest.mark.cuda
def test_a_snapshot_of_cuda_tensors_on_disk_is_written_from_pinned_buffers_and_read_back(tmp_path):
    live = {"w": torch.randn(1024, 1024, device="cuda"), "rng": torch.cuda.get_rng_state()}
    writer = checkpoint.AsyncWriter()
    writer.write(str(tmp_path / "snap.pt"), live)
    live["w"].mul_(2)  # the training goes on: the file has the state of the call
    writer.wait()
    # the CUDA tensor's buffer (the RNG state is a CPU tensor)
    assert writer.buffers[("w",)].is_pinned()
    back = torch.load(tmp_path / "snap.pt", map_location="cpu", weights_only=False)
    assert torch.equal(back["w"] * 2, live["w"].cpu())


def test_the_dry_run_reports_the_snapshots_host_memory(capsys, monkeypatch):
    import estimate

    cfg = arguments.load_config(["config/tr11_176b.py", "--spike_guard"])
    assert snapshots.keep(plan(cfg)) == 5  # rewind 100, a snapshot every 50
    # bf16: 2 bytes of weights and 12 of fp32 masters and Adam's moments per parameter, sharded over DP (ZeRO-1)
    assert snapshots.snapshot_bytes(plan(cfg), 10**9, 8) == 10**9 * (2 + 12 / 8)
    assert (
        snapshots.snapshot_bytes(plan(cfg), 10**9, 8, optimizer_params=3 * 10**8)
        == 10**9 * 2 + 3 * 10**8 * 12
    )
    cfg = arguments.load_config(
        [
            "--num_layers=2",
            "--hidden_size=64",
            "--num_attention_heads=4",
            "--spike_guard",
            "--spike_guard_rewind=10",
            "--spike_guard_snapshot_interval=5",
        ]
    )
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    estimate.dry_run(cfg)
    out = capsys.readouterr().out
    assert (
        re.search(
            r"spike guard snapshots: 5 x \d\.\d\d GiB = \d\.\d\d GiB of host memory per GPU, x 1 GPUs per "
            r"node = \d+\.\d GiB of the node's \d+ GiB",
            out,
        )
        and "does not fit" not in out
    )
    monkeypatch.setattr(snapshots, "node_memory", lambda: 2**20)
    estimate.dry_run(cfg)
    assert "does not fit: spike guard snapshots need" in capsys.readouterr().out


# tr11-176B's largest stage on TP4 x PP12, bf16, an even ZeRO-1 DP8
TR11_SNAPSHOT = 3_982_551_552 * (2 + 12 / 8)


def test_snapshots_that_do_not_fit_the_node_are_refused_with_the_keys_that_make_them_fit():
    """tr11 on nodes of 8 GPUs and 512 GiB: 5 snapshots of 12.98 GiB per GPU are 519 GiB; 3 fit in 3/4 of it."""
    cfg = arguments.load_config(["config/tr11_176b.py", "--spike_guard"])
    node = 512 * 2**30
    line, problem = snapshots.describe_host_memory(plan(cfg), TR11_SNAPSHOT, 8, node)
    assert "5 x 12.98 GiB = 64.91 GiB of host memory per GPU, x 8 GPUs per node = 519.3 GiB" in line
    assert problem.startswith(
        "spike guard snapshots need 519.3 GiB of host memory per node (5 x 12.98 GiB per GPU x "
        "8 GPUs), more than 75% of the node's 512 GiB: 3 per GPU fit"
    )
    # 3 fit: ceil(2 x 100 / interval) + 1 <= 3 with an interval of 100, or a rewind of 50 at 50
    assert "spike_guard_snapshot_interval 100 or more, or spike_guard_rewind 50 or less" in problem
    assert (
        "spike_guard_snapshot_dir=$SLURM_TMPDIR" in problem
        and "spike_guard_snapshot_interval=0" in problem
    )
    with pytest.raises(ValueError, match="519.3 GiB of host memory per node"):
        snapshots.check_host_memory(plan(cfg), TR11_SNAPSHOT, 8, node)
    cfg.spike_guard_snapshot_interval = 100  # what the message says: 3 snapshots now
    assert snapshots.keep(plan(cfg)) == 3
    assert snapshots.describe_host_memory(plan(cfg), TR11_SNAPSHOT, 8, node)[1] is None
    # on disk: one copy in memory
    cfg.spike_guard_snapshot_interval, cfg.spike_guard_snapshot_dir = 50, "/tmp"
    line, problem = snapshots.describe_host_memory(plan(cfg), TR11_SNAPSHOT, 8, node)
    assert (
        problem is None
        and "1 x 12.98 GiB = 12.98 GiB of host memory per GPU (and 5 on disk in /tmp)" in line
    )
    # not even one
    _, problem = snapshots.describe_host_memory(plan(cfg), TR11_SNAPSHOT, 8, 64 * 2**30)
    assert ": 0 per GPU fit" in problem and "spike_guard_snapshot_interval=0" in problem


def test_the_run_refuses_at_its_start_snapshots_the_node_cannot_hold(monkeypatch):
    cfg = arguments.load_config(["--spike_guard"])
    monkeypatch.setattr(snapshots, "node_memory", lambda: 2**20)  # 1 MiB
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(
        ValueError, match="spike guard snapshots need .* GiB of host memory per node"
    ):
        snapshots_of(cfg, torch.nn.Linear(256, 256))
    snapshots_of(cfg, torch.nn.Linear(4, 4))  # 1 MiB holds 5 x 20 parameters


def test_a_ranks_snapshot_holds_the_optimizer_state_of_the_parameters_zero1_deals_it(monkeypatch):
    cfg = arguments.load_config(["--spike_guard", "--zero_stage=1"])
    # 65,536 + 256 parameters: the weight to DP rank 0, the bias to rank 1
    model = torch.nn.Linear(256, 256)
    for rank, owned in ((0, 65536), (1, 256)):
        monkeypatch.setattr(parallel, "grid", parallel.Grid(world_size=2, rank=rank))
        # fp32 weights, Adam's moments
        assert snapshots.rank_snapshot_bytes(plan(cfg), model) == 4 * 65792 + 8 * owned


def _refused_on_every_rank():
    snapshots.node_memory = lambda: 2**20
    cfg = arguments.load_config(["--spike_guard"])
    # rank 1's snapshots do not fit: on both
    with pytest.raises(ValueError, match="spike guard snapshots need"):
        snapshots_of(
            cfg, torch.nn.Linear(4, 4) if parallel.grid.rank == 0 else torch.nn.Linear(256, 256)
        )


def test_every_rank_refuses_when_one_ranks_snapshots_do_not_fit():
    """Stages and ZeRO-1 shards differ in size: the verdict is the largest rank's on every rank (one refusing
    alone would leave the others waiting at their next collective)."""
    spawn(_refused_on_every_rank, 2)


def test_node_memory_is_the_physical_memory_or_a_cgroups_limit():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < snapshots.node_memory() <= physical
    assert snapshots.parents("/system.slice/job_1/step_0") == [
        "/system.slice/job_1/step_0",
        "/system.slice/job_1",
        "/system.slice",
        "",
    ]
    assert snapshots.parents("/") == [""]


def test_a_rollback_to_a_snapshot_on_disk_is_the_rollback_to_one_in_memory(corpus512, tmp_path):
    """An LR spike at 20-23 rolls back to the snapshot of iteration 15, dropout on: every later loss, bit for
    bit, the same whether the snapshots were in host memory or in files; none are left on the disk."""
    args = [
        "--num_layers=2",
        "--hidden_size=64",
        "--num_attention_heads=4",
        "--seq_length=32",
        "--vocab_size=512",
        "--micro_batch_size=4",
        "--global_batch_size=8",
        "--train_iters=28",
        "--lr=2e-3",
        "--lr_warmup_samples=40",
        "--lr_decay_samples=800",
        "--hidden_dropout=0.1",
        "--attention_dropout=0.1",
        "--log_interval=1",
        "--eval_interval=1000",
        "--eval_iters=0",
        "--sample_tokens=0",
        "--save=none",
        "--save_interval=none",
        f"--data_path={corpus512}",
        "--inject_lr_iters=20-23",
        "--inject_lr_factor=1000",
        "--spike_guard",
        "--spike_guard_window=10",
        "--spike_guard_min_steps=8",
        "--spike_guard_rewind=3",
        "--spike_guard_snapshot_interval=5",
    ]
    memory = run_main(*args)
    disk = run_main(*args, f"--spike_guard_snapshot_dir={tmp_path / 'local'}")
    assert "spike guard: rolled back to iteration 15" in disk
    assert {i: f["lm loss"] for i, f in log_fields(disk).items() if "lm loss" in f} == {
        i: f["lm loss"] for i, f in log_fields(memory).items() if "lm loss" in f
    }
    assert os.listdir(tmp_path / "local") == []


# -- pinned host buffers: as CUDA's caching host allocator reserves them; async_save's copy counted --------------


def test_pinned_buffers_are_counted_as_the_caching_host_allocator_rounds_them(monkeypatch):
    """The snapshots' (and async_save's) host copies of CUDA tensors go to pinned buffers, which the caching host
    allocator rounds up to powers of two, each tensor on its own: a rank's snapshot is counted so; without a GPU
    (no pinning) at its bytes."""
    assert [checkpoint.pinned_bytes(n) for n in (0, 1, 3, 4096, 4097, 11 * 2**30 // 10)] == [
        0,
        1,
        4,
        4096,
        8192,
        2 * 2**30,
    ]
    cfg = arguments.load_config(["--spike_guard", "--bf16"])
    model = torch.nn.Linear(256, 300).to(torch.bfloat16)  # a 153,600-byte weight, a 600-byte bias
    assert (
        snapshots.rank_snapshot_bytes(plan(cfg), model)
        == snapshots.rank_snapshot_bytes(plan(cfg), model, pinned=False)
        == snapshots.snapshot_bytes(plan(cfg), 77100, 1)
        == 77100 * (2 + 12)
    )  # CPU tensors: not pinned
    # bf16 weights, then the fp32 master and Adam's two moments of each parameter: one buffer each
    assert snapshots.rank_snapshot_bytes(plan(cfg), model, pinned=True) == 2**18 + 2**10 + 3 * (
        2**19 + 2**11
    )
    cfg = arguments.load_config(["--spike_guard", "--bf16", "--zero_stage=1"])
    # ZeRO-1: the bias's state here
    monkeypatch.setattr(parallel, "grid", parallel.Grid(world_size=2, rank=1))
    assert snapshots.rank_snapshot_bytes(plan(cfg), model, pinned=True) == 2**18 + 2**10 + 3 * 2**11


def test_async_saves_host_copy_is_counted_beside_the_snapshots():
    """async_save keeps one more copy of the run in host memory (checkpoint.AsyncWriter's buffers): tr11 with 3
    snapshots fitted in 3/4 of 512 GiB; with async_save the 4 copies do not, and the message says what to change."""
    cfg = arguments.load_config(
        ["config/tr11_176b.py", "--spike_guard", "--spike_guard_snapshot_interval=100"]
    )
    node = 512 * 2**30
    assert snapshots.host_copies(plan(cfg)) == 3
    assert snapshots.describe_host_memory(plan(cfg), TR11_SNAPSHOT, 8, node)[1] is None
    cfg.async_save = True
    assert snapshots.host_copies(plan(cfg)) == 4
    line, problem = snapshots.describe_host_memory(plan(cfg), TR11_SNAPSHOT, 8, node)
    assert line.startswith("spike guard snapshots and async_save's copy: 4 x 12.98 GiB = 51.93 GiB")
    assert (
        problem.startswith(
            "spike guard snapshots and async_save's copy need 415.4 GiB of host memory per node "
            "(4 x 12.98 GiB per GPU x 8 GPUs)"
        )
        and ": 3 per GPU fit" in problem
    )
    # 2 snapshots beside the async copy: ceil(2 x 100 / interval) + 1 <= 2 with an interval of 200
    assert "spike_guard_snapshot_interval 200 or more" in problem and "async_save=false" in problem
    cfg.spike_guard_snapshot_dir = "/tmp"  # one snapshot in memory, one async copy
    line, problem = snapshots.describe_host_memory(plan(cfg), TR11_SNAPSHOT, 8, node)
    assert problem is None and "2 x 12.98 GiB = 25.96 GiB of host memory per GPU" in line


@pytest.mark.cuda
def test_a_pinned_buffer_takes_what_pinned_bytes_says():
    """On a GPU: the pinned host memory the caching host allocator takes from CUDA for a request
    (torch.cuda.host_memory_stats' allocated_bytes, "using the rounded block size requested from CUDA") is
    checkpoint.pinned_bytes of it. In a fresh process: a block an earlier test freed would be handed out again
    without taking any (0 on the first GPU run, torch 2.11), and active_bytes is no measure either (a freed
    block stays counted until its stream's events are processed)."""
    code = (
        "import json, torch\n"
        "torch.cuda.init()\n"
        "stat = lambda: torch.cuda.host_memory_stats().get('allocated_bytes.current', 0)\n"
        "grown, kept = [], []\n"
        "for n in (3 * 2**20 + 1, 5 * 2**20, 2**20):\n"
        "    before = stat()\n"
        "    kept.append(torch.empty(n, dtype=torch.uint8, pin_memory=True))\n"
        "    grown.append([n, stat() - before])\n"
        "print(json.dumps(grown))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grown = json.loads(out.stdout.strip().splitlines()[-1])
    assert (
        [g for _, g in grown]
        == [checkpoint.pinned_bytes(n) for n, _ in grown]
        == [4 * 2**20, 8 * 2**20, 2**20]
    )


class _Latest(training.Callback):
    """After each iteration: (the iteration, the one the checkpoint `latest` names in save_dir)."""

    name = "latest_spy"

    def __init__(self, save_dir):
        self.save_dir, self.seen = save_dir, []

    def after_iteration(self, iteration):
        tag = checkpoint.latest_dir(self.save_dir)
        self.seen.append((iteration, int(re.search(r"\d+$", tag).group()) if tag else 0))


def test_a_rollback_to_a_disk_checkpoint_saves_it_so_latest_never_names_the_abandoned_timeline(
    corpus512, tmp_path, monkeypatch
):
    """Without snapshots the guard rolls back to the disk checkpoints in save: the run goes on from
    iteration 35 while `latest` named global_step40 of the timeline it left, so a run killed before
    its next save resumed there, the spike's timeline, without the rollback's decisions. The state
    rolled back to is saved again at once (as remedies' restarts do)."""
    import builders

    save = str(tmp_path / "disk")
    spy, real = _Latest(save), builders.build_callbacks
    monkeypatch.setattr(
        builders, "build_callbacks", lambda *args: training.Callbacks([*real(*args).callbacks, spy])
    )
    out = run_main(
        "--num_layers=2",
        "--hidden_size=64",
        "--num_attention_heads=4",
        "--seq_length=64",
        "--vocab_size=512",
        "--micro_batch_size=8",
        "--global_batch_size=8",
        "--train_iters=45",
        "--lr=2e-3",
        "--lr_warmup_samples=40",
        "--lr_decay_samples=1600",
        "--hidden_dropout=0",
        "--attention_dropout=0",
        "--eval_iters=0",
        "--sample_tokens=0",
        f"--data_path={corpus512}",
        "--inject_lr_iters=40-45",
        "--inject_lr_factor=1000",
        "--spike_guard_update_ratio=0",
        "--spike_guard",
        "--spike_guard_window=20",
        "--spike_guard_min_steps=10",
        "--spike_guard_rewind=3",
        "--spike_guard_snapshot_interval=0",
        f"--save={save}",
        "--save_interval=5",
    )
    assert "spike guard: rolled back to iteration 35" in out
    ahead = [(it, latest) for it, latest in spy.seen if latest > it]
    assert not ahead, (
        f"`latest` named a later iteration than the run's (iteration, latest): {ahead}"
    )
    # after the rollback: its state
    assert [latest for it, latest in spy.seen if it == 36][-1] == 35
    state = torch.load(
        os.path.join(save, "global_step35", "mp_rank_00_000_model_states.pt"), weights_only=False
    )
    decisions = state["run"]["state"]["callbacks"]["spike_guard"]["decisions"]
    # kept
    assert decisions[-1]["action"] == "rollback" and decisions[-1]["restored_iteration"] == 35
