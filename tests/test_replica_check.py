"""The DP replica check (stability/replica_check.py) on 2 gloo processes: a bit flipped on DP rank 1 -- a low (23,
24: x2 or x4) or the top (30) exponent bit of an fp32, in a weight or in an Adam moment -- is found, named and
re-synced, and the run then is the run without the flip, bit for bit (its weights and both ranks' Adam moments);
with the guard, two replicas that differ roll back to the snapshot before the flip. A clean run is unchanged by
the check, and the check costs nothing on the iterations between checks.

Without the check (dp_replica_check_interval=0, the code before it) every flipped run ends with rank 1's weights
or moments different from rank 0's: no other part of the run compares them."""

import contextlib
import io
import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import training
from helpers import ROOT, spawn, synthetic_corpus, train_script  # noqa: F401 (synthetic_corpus: a fixture)
from training import StopRun

ARGS = [
    "--num_layers=2",
    "--hidden_size=64",
    "--num_attention_heads=4",
    "--seq_length=32",
    "--vocab_size=512",
    "--make_vocab_size_divisible_by=128",
    "--hidden_dropout=0",
    "--attention_dropout=0",
    "--micro_batch_size=2",
    "--global_batch_size=4",
    "--train_iters=8",
    "--lr=5e-3",
    "--min_lr=1e-4",
    "--lr_warmup_samples=8",
    "--log_interval=1",
    "--eval_interval=1000",
    "--eval_iters=0",
    "--sample_tokens=0",
    "--device=cpu",
    "--save_interval=none",
    "--dump_weights",
]
# after iteration 4's update, on DP rank 1
FLIP = ["--inject_bitflip_iters=4-4", "--inject_bitflip_rank=1"]
CHECK = ["--dp_replica_check_interval=4"]
GUARDED = [
    "--dp_replica_check_interval=2",
    "--spike_guard",
    "--spike_guard_snapshot_interval=2",
    "--spike_guard_rewind=4",
    "--inject_bitflip_iters=3-3",
    "--inject_bitflip_rank=1",
    "--inject_bitflip_target=weight",
    "--inject_bitflip_bit=23",
]
RUNS = {
    "off": ["--dp_replica_check_interval=0"],  # the reference: no flip, no check
    "clean": CHECK,
    "weight bit 23": [*CHECK, *FLIP, "--inject_bitflip_target=weight", "--inject_bitflip_bit=23"],
    "weight bit 30": [*CHECK, *FLIP, "--inject_bitflip_target=weight", "--inject_bitflip_bit=30"],
    "exp_avg_sq bit 24": [
        *CHECK,
        *FLIP,
        "--inject_bitflip_target=exp_avg_sq",
        "--inject_bitflip_bit=24",
    ],
    "exp_avg bit 30": [*CHECK, *FLIP, "--inject_bitflip_target=exp_avg", "--inject_bitflip_bit=30"],
    "bf16 off": ["--bf16", "--dp_replica_check_interval=0"],
    "master bit 23": [
        "--bf16",
        *CHECK,
        *FLIP,
        "--inject_bitflip_target=master",
        "--inject_bitflip_bit=23",
    ],
    # ZeRO-1: the weights are compared, the optimizer's shards are not (each DP rank holds its own); the first
    # matrix's state is DP rank 0's (parallel.deal_out)
    "zero1 weight bit 23": [
        "--zero_stage=1",
        *CHECK,
        *FLIP,
        "--inject_bitflip_target=weight",
        "--inject_bitflip_bit=23",
    ],
    "zero1 exp_avg_sq bit 24": [
        "--zero_stage=1",
        *CHECK,
        "--inject_bitflip_iters=4-4",
        "--inject_bitflip_rank=0",
        "--inject_bitflip_target=exp_avg_sq",
        "--inject_bitflip_bit=24",
    ],
    "unchecked flip": [
        "--dp_replica_check_interval=0",
        *FLIP,
        "--inject_bitflip_target=weight",
        "--inject_bitflip_bit=23",
    ],
    # flipped after iteration 3, found at 4; the snapshot of 2 followed the check of 2, which agreed
    "guarded": GUARDED,
    # the same, with a hardware fault the guard's cap: its last good state saved, and stopped
    "capped": [*GUARDED, "--spike_guard_max_hardware_faults=1"],
}
# the cost: the clean run's check every 4 iterations against one built but never due
COUNTED = {"clean": CHECK, "never due": ["--dp_replica_check_interval=1000"]}
HOST_READS = {"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "cpu"}
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "barrier",
)


class Counted(TorchFunctionMode):
    """Per iteration (the train_step calls so far): host reads of tensor values, and collectives by name."""

    def __init__(self):
        super().__init__()
        self.iteration, self.counts, self.patched = 0, {}, []

    def add(self, what):
        counts = self.counts.setdefault(self.iteration, {})
        counts[what] = counts.get(what, 0) + 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (
            getattr(func, "__name__", "") in HOST_READS
            and args
            and isinstance(args[0], torch.Tensor)
        ):
            self.add(func.__name__)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self.patched.append((name, original))
            setattr(
                dist,
                name,
                lambda *a, _name=name, _f=original, **k: (self.add(_name), _f(*a, **k))[1],
            )
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self.patched:
            setattr(dist, name, original)
        return super().__exit__(*exc)


def _main(argv, out_path, counted=None):
    step = training.train_step  # train.py calls it through the module: a spy there counts its steps

    def counting_step(*a, **k):
        counted.iteration += 1
        return step(*a, **k)

    if counted is not None:
        training.train_step = counting_step
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            try:
                train_script()["main"](argv)
            # the guard's stop: its message is the run's last line, as train.py prints it
            except StopRun as e:
                print(f"stopped: {e}")
    finally:
        training.train_step = step
    with open(out_path, "w") as f:
        f.write(out.getvalue())


def _runs(corpus, directory):
    os.chdir(ROOT)
    rank = dist.get_rank()
    for name, extra in RUNS.items():
        if name in COUNTED:
            continue
        save = os.path.join(directory, name.replace(" ", "_"))
        _main([*ARGS, f"--data_path={corpus}", f"--save={save}", *extra], f"{save}-rank{rank}.txt")
    for name, extra in COUNTED.items():
        save = os.path.join(directory, name.replace(" ", "_"))
        with Counted() as counted:
            _main(
                [*ARGS, f"--data_path={corpus}", f"--save={save}", *extra],
                f"{save}-rank{rank}.txt",
                counted,
            )
        with open(f"{save}-counts-rank{rank}.json", "w") as f:
            json.dump(counted.counts, f)


@pytest.fixture(scope="module")
def runs(synthetic_corpus, tmp_path_factory):
    directory = tmp_path_factory.mktemp("replica_check")
    spawn(_runs, 2, 1, 1, synthetic_corpus, str(directory))

    def read(name):
        """(stdout of both ranks, [rank 0's, rank 1's] {weight name: tensor}, [their optimizer states])."""
        base = directory / name.replace(" ", "_")
        out = "".join((directory / f"{base.name}-rank{r}.txt").read_text() for r in range(2))
        weights = [
            torch.load(next((base / "weight_dumps").glob(f"debug-8-*-dp{r}-*-before-save.pt")))
            for r in range(2)
        ]
        states = [
            torch.load(base / "global_step8" / f"rank_{r:05d}_optim_states.pt", weights_only=False)
            for r in range(2)
        ]
        # Adam's state, its groups, bf16's fp32 masters
        return out, weights, [s["optimizer"] for s in states]

    read.directory = directory
    return read


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def _lines(out):
    return [
        x
        for x in out.splitlines()
        if x.startswith(("DP replica check", "spike guard:")) and "injected a bit flip" not in x
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["weight bit 23", "weight bit 30", "exp_avg_sq bit 24", "exp_avg bit 30", "master bit 23"],
)
def test_a_flipped_bit_on_one_replica_is_named_resynced_and_the_run_is_the_clean_one(runs, name):
    """The flip after iteration 4's update is found by the check of iteration 4, before any step computes with it:
    rank 1 is named with its host, DP rank 0's copy taken (two replicas: no majority), and the run goes on as if
    nothing had flipped -- both ranks' final weights and Adam moments (and bf16's fp32 masters) are the unflipped
    run's, bit for bit."""
    out, weights, states = runs(name)
    _, reference, reference_states = runs("bf16 off" if name.startswith("master") else "off")
    assert "injected a bit flip" in out
    kind = {"weight": "weights", "master": "fp32 masters"}.get(name.split()[0], "optimizer state")
    assert _lines(out)[0] == (
        f"DP replica check: iteration 4: DP rank 1 (global rank 1) in its {kind} differs from "
        "DP rank 0: no majority tells which is right: DP rank 0's copy taken (no snapshot of "
        "equal replicas to roll back to)"
    ), _lines(out)
    assert re.search(r"DP replica check: iteration 4: DP rank 1 is global rank 1 on host \S+", out)
    # the line, 2 hosts
    assert len([x for x in _lines(out) if x.startswith("DP replica check: iteration")]) == 3
    for rank in range(2):
        assert _same(weights[rank], reference[0]), f"rank {rank}'s weights"
        assert _same(states[rank], reference_states[0]), f"rank {rank}'s optimizer state"


@pytest.mark.slow
def test_without_the_check_the_replicas_drift_apart_silently(runs):
    """The wrong behaviour of issue 41: the flip leaves rank 1's weights apart to the end, and nothing is said."""
    out, weights, _ = runs("unchecked flip")
    assert not _lines(out)
    assert not _same(weights[0], weights[1])


@pytest.mark.slow
def test_under_zero1_a_weight_is_compared_and_a_moment_of_the_owners_shard_cannot_be(runs):
    """ZeRO-1: a weight flipped on DP rank 1 is found and re-synced, and the run is the unflipped one (ZeRO-1's
    weights are bitwise those of the unsharded run). A flipped moment of DP rank 0's shard is not seen: no replica
    holds another copy of it, and the owner's updates reach every replica alike -- they end equal to each other
    and apart from the unflipped run (what only the spike guard can catch)."""
    out, weights, _ = runs("zero1 weight bit 23")
    _, reference, _ = runs("off")
    assert _lines(out)[0].startswith(
        "DP replica check: iteration 4: DP rank 1 (global rank 1) in its weights "
        "differs from DP rank 0"
    ), _lines(out)
    assert _same(weights[0], reference[0]) and _same(weights[1], reference[0])
    out, weights, _ = runs("zero1 exp_avg_sq bit 24")
    assert "injected a bit flip into exp_avg_sq element" in out and not _lines(out)
    assert _same(weights[0], weights[1]) and not _same(weights[0], reference[0])


@pytest.mark.slow
def test_a_clean_run_is_unchanged_by_the_check_and_says_nothing(runs):
    out, weights, states = runs("clean")
    _, reference, reference_states = runs("off")
    assert not _lines(out)
    assert _same(weights[0], reference[0]) and _same(weights[1], reference[0])
    assert _same(states[1], reference_states[0])


@pytest.mark.slow
def test_with_the_guard_two_replicas_that_differ_roll_back_to_the_snapshot_of_equal_ones(runs):
    """Flipped after iteration 3, found at 4. Two replicas: which one is right cannot be told, but the check of 2
    agreed and its snapshot holds equal replicas: the run rolls back to it (no data skipped, the LR kept), meets no
    flip on its second pass, and ends as the unflipped run. The finding counts as a hardware fault (of an unknown
    DP rank) in the guard's count, which its checkpoint keeps."""
    out, weights, states = runs("guarded")
    _, reference, reference_states = runs("off")
    lines = _lines(out)
    assert lines[0].startswith(
        "DP replica check: iteration 4: DP rank 1 (global rank 1) in its weights differs from "
        "DP rank 0: no majority tells which is right"
    ), lines
    assert (
        "spike guard: iteration 4: the DP replicas differ and no majority tells the healthy one: roll back to the "
        "newest snapshot at or before iteration 2 (the last check that agreed); no data skipped, LR unchanged"
        in lines
    )
    assert "spike guard: rolled back to iteration 2" in lines
    # an event in time: the second pass does not meet it
    assert out.count("injected a bit flip") == 1
    for rank in range(2):
        assert _same(weights[rank], reference[0]), f"rank {rank}'s weights"
        assert _same(states[rank], reference_states[0]), f"rank {rank}'s optimizer state"
    saved = torch.load(
        runs.directory / "guarded" / "global_step8" / "mp_rank_00_000_model_states.pt",
        weights_only=False,
    )
    callbacks = saved["run"]["state"]["callbacks"]
    assert callbacks["spike_guard"]["faults"] == callbacks["replica_check"]["faults"] == {None: 1}


@pytest.mark.slow
def test_the_check_costs_one_all_gather_and_one_host_read_on_its_iterations_and_nothing_between(
    runs,
):
    counts = [
        json.loads((runs.directory / f"{name}-counts-rank1.json").read_text())
        for name in ("clean", "never_due")
    ]
    checked, baseline = counts
    assert sorted(checked) == sorted(baseline) and len(checked) >= 8
    for iteration in checked:
        expected = dict(baseline[iteration])
        if iteration in ("4", "8"):
            expected["all_gather"] = expected.get("all_gather", 0) + 1
            expected["tolist"] = expected.get("tolist", 0) + 1
        assert checked[iteration] == expected, f"iteration {iteration}"


@pytest.mark.slow
def test_at_the_guards_hardware_cap_the_run_saves_the_state_of_equal_replicas_and_stops(runs):
    """spike_guard_max_hardware_faults=1: the finding of iteration 4 is the cap. The run stops, naming the fault, and
    what it saves is its last good state -- the snapshot of iteration 2, replicas equal -- not the differing ones."""
    directory = runs.directory / "capped"
    out = "".join((runs.directory / f"capped-rank{r}.txt").read_text() for r in range(2))
    assert (
        "spike guard: iteration 4: 1 faults on an unknown DP rank (two replicas differ), the "
        "spike_guard_max_hardware_faults=1th: take its node out"
    ) in _lines(out)
    assert re.search(
        r"^stopped: .*take its node out; the state of iteration 2 saved in \S+: "
        r"take the named rank's node out",
        out,
        re.M,
    )
    assert (directory / "latest").read_text().strip() == "global_step2"
    dumped = [
        torch.load(next((directory / "weight_dumps").glob(f"debug-2-*-dp{r}-*-before-save.pt")))
        for r in range(2)
    ]
    assert _same(dumped[0], dumped[1])
    off = runs.directory / "off"
    assert not list((off / "weight_dumps").glob("debug-2-*"))  # the reference saved at the end only


def _hosts(directory):
    import socket

    import parallel
    from stability import guard

    socket.gethostname = lambda: f"node{dist.get_rank()}"  # TP2 x DP2: DP rank 1 is ranks 2 and 3
    found = [guard.hosts_of(1), guard.hosts_of(0), guard.hosts_of(None)]
    with open(os.path.join(directory, f"hosts-rank{parallel.grid.rank}.json"), "w") as f:
        json.dump(found, f)


def test_a_stop_record_names_the_hosts_of_the_faulty_dp_rank(tmp_path):
    """The stop's record (DIR/stopped.json) names the hosts of every process of the rank at fault -- for a requeue
    script's --exclude -- gathered from every rank, so each rank writes the same (TP2 x DP2, 4 processes)."""
    spawn(_hosts, 4, 2, 1, str(tmp_path))
    for rank in range(4):
        found = json.loads((tmp_path / f"hosts-rank{rank}.json").read_text())
        assert found == [["node2", "node3"], ["node0", "node1"], []], (rank, found)


THREE = {
    "off": ["--dp_replica_check_interval=0"],
    # DP rank 0 itself flipped: the copy must come from the majority (DP rank 1), not from rank 0
    "rank 0 flipped": [
        *CHECK,
        "--inject_bitflip_iters=4-4",
        "--inject_bitflip_rank=0",
        "--inject_bitflip_target=exp_avg_sq",
        "--inject_bitflip_bit=23",
    ],
}


def _three_runs(corpus, directory):
    os.chdir(ROOT)
    rank = dist.get_rank()
    for name, extra in THREE.items():
        save = os.path.join(directory, name.replace(" ", "_"))
        _main(
            [
                *ARGS,
                "--global_batch_size=6",
                "--train_iters=5",
                f"--data_path={corpus}",
                f"--save={save}",
                *extra,
            ],
            f"{save}-rank{rank}.txt",
        )


@pytest.mark.slow
def test_with_three_replicas_the_odd_one_is_copied_from_the_majority_even_dp_rank_0(
    synthetic_corpus, tmp_path
):
    """3 gloo processes (DP3): a low bit of Adam's second moment flipped on DP rank 0. The two others agree: rank 0 is
    named and takes DP rank 1's state, and all three end with the weights and moments of the unflipped run."""
    spawn(_three_runs, 3, 1, 1, synthetic_corpus, str(tmp_path))
    out = "".join((tmp_path / f"rank_0_flipped-rank{r}.txt").read_text() for r in range(3))
    assert _lines(out)[0] == (
        "DP replica check: iteration 4: DP rank 0 (global rank 0) in its optimizer state differs "
        "from the 2 of 3 replicas that agree: re-synced from DP rank 1"
    ), _lines(out)
    assert re.search(r"DP replica check: iteration 4: DP rank 0 is global rank 0 on host \S+", out)
    assert len(_lines(out)) == 2

    def final(name, rank):
        base = tmp_path / name.replace(" ", "_")
        weights = torch.load(
            next((base / "weight_dumps").glob(f"debug-5-*-dp{rank}-*-before-save.pt"))
        )
        state = torch.load(
            base / "global_step5" / f"rank_{rank:05d}_optim_states.pt", weights_only=False
        )
        return weights, state["optimizer"]

    reference = final("off", 0)
    for rank in range(3):
        weights, state = final("rank 0 flipped", rank)
        assert _same(weights, reference[0]) and _same(state, reference[1]), f"rank {rank}"


# -- the pieces, on numbers ----------------------------------------------------------------------------------------


def test_the_checksum_sees_any_single_flipped_bit_where_a_float_sum_misses_the_low_ones():
    from stability.replica_check import checksums

    t = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    before = checksums([[t]], t.device)
    missed = []
    for bit in range(32):
        flipped = t.clone()
        flipped.view(torch.int32)[7] ^= 1 << bit
        assert not torch.equal(checksums([[flipped]], t.device), before), f"bit {bit}"
        if flipped.sum() == t.sum():
            missed.append(bit)
    # the float sum rounds the lowest mantissa bits away: why the bits are summed as integers
    assert missed
    half = t.bfloat16()
    flipped = half.clone()
    flipped.view(torch.int16)[7] ^= 1 << 7  # bf16's lowest exponent bit
    assert not torch.equal(checksums([[flipped]], t.device), checksums([[half]], t.device))


def test_the_majority_is_copied_from_and_without_one_dp_rank_0_and_each_dp_group_is_judged_apart(
    monkeypatch,
):
    import parallel
    from stability.replica_check import describe, differing

    same, odd = [1, 2, 3], [1, 2, 4]
    monkeypatch.setattr(parallel, "grid", parallel.Grid(1, 1, world_size=4, rank=0))
    assert differing([same, same, same, same]) == {}
    assert differing([same, same, odd, same]) == {(0, 0): (0, [2])}
    # DP rank 0 itself in the minority
    assert differing([odd, same, same, same]) == {(0, 0): (1, [0])}
    # two against two: no majority
    assert differing([same, same, odd, odd]) == {(0, 0): (None, [2, 3])}
    assert describe(5, 0, 0, 1, [0], [odd, same, same, same], False) == (
        "DP replica check: iteration 5: DP rank 0 (global rank 0) in its optimizer state differs from the 3 of 4 "
        "replicas that agree: re-synced from DP rank 1"
    )
    # TP2 x DP2: TP is fastest, so the DP group of TP rank 1 is global ranks 1 and 3
    monkeypatch.setattr(parallel, "grid", parallel.Grid(2, 1, world_size=4, rank=0))
    assert differing([same, same, same, odd]) == {(1, 0): (None, [1])}


def test_asked_for_with_one_replica_the_check_says_it_checks_nothing():
    """A config of many GPUs run on one process: the check has nothing to compare, and said nothing."""
    from helpers import run_main

    tiny = ["--num_layers=1", "--hidden_size=32", "--num_attention_heads=2", "--seq_length=16"]
    args = [
        *tiny,
        "--micro_batch_size=2",
        "--global_batch_size=2",
        "--train_iters=2",
        "--eval_iters=0",
    ]
    out = run_main(*args, "--save=none", "--sample_tokens=0", "--dp_replica_check_interval=1")
    assert (
        "replica check: dp_replica_check_interval=1 compares the data-parallel replicas, and this run has one: "
        "nothing is checked"
    ) in out
    assert "replica check:" not in run_main(*args, "--save=none", "--sample_tokens=0")
