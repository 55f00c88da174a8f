"""bench.py: one profiled iteration's time split into shares (bench.COSTS), checked against work whose share is
known by construction (an injected clock, one kind of op at a time), and on a real tiny model; bench on every
shipped config; --table one process per row; fp16 timed from a loss scale at which steps update. No assertion
here depends on how fast anything ran."""

import glob
import json
import os

import pytest
import torch
import torch.nn.functional as F

import arguments
import bench
import cross_entropy
import optim
import parallel
from builders import build_model
from helpers import corpus, corpus512  # noqa: F401 (fixtures)

CPU = torch.device("cpu")


class Optimizer:
    """What costs_named wraps: an optimizer's step (here an elementwise op that only the range can place)."""

    def __init__(self):
        self.w = torch.zeros(1 << 16)

    def step(self):
        self.w.add_(1.0)


class Clock:
    """A clock that moves only when told: the wall time and the data wait of step_costs, with nothing to race."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def shares(run, fetch=lambda: None, optimizer=None, clock=None):
    costs = bench.step_costs(fetch, run, optimizer or Optimizer(), CPU, clock=clock or Clock())
    assert list(costs) == list(bench.COSTS)
    assert all(share >= 0 for share in costs.values()), costs
    assert sum(costs.values()) == pytest.approx(1.0, abs=1e-9), costs
    return costs


def test_waiting_is_data_wait_and_other():
    """A batch that takes 1000 s (of the injected clock) to come is the data wait; 1000 s more in the step that no
    op accounts for is "other"; the op itself (a real matmul, microseconds) takes the little that is left."""
    clock, a = Clock(), torch.randn(64, 64)

    def run(_):
        a @ a
        clock.advance(1000)

    costs = shares(run, fetch=lambda: clock.advance(1000), clock=clock)
    assert costs["data wait"] == pytest.approx(0.5, abs=1e-12), costs
    assert costs["other"] == pytest.approx(0.5, abs=1e-3) and costs["other matmuls"] > 0, costs


def test_the_shares_of_known_times():
    spent = dict.fromkeys(bench.COSTS, 0.0) | {"attention": 30.0, "data wait": 10.0}
    assert bench.shares(spent, wall=100.0) == dict.fromkeys(bench.COSTS, 0.0) | {
        "attention": 0.3,
        "data wait": 0.1,
        "other": 0.6,
    }
    # ops on overlapping streams adding up to more than the wall time: shares of their sum, no "other"
    assert bench.shares(spent, wall=20.0) == dict.fromkeys(bench.COSTS, 0.0) | {
        "attention": 0.75,
        "data wait": 0.25,
    }


def test_each_kind_of_op_goes_to_its_share():
    """With a clock that stands still, no wall time is left for "other": the shares are of the ops' own times, and
    each run's work is of one kind (its inputs made before it), so that kind takes nearly all of it."""
    q = torch.randn(2, 4, 256, 32)
    a, w = torch.randn(256, 256), torch.randn(256, 256)
    optimizer = Optimizer()

    def attention(_):
        for _ in range(20):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)

    def matmuls(_):
        for _ in range(20):
            F.linear(a, w)

    def elementwise(_):
        for _ in range(20):
            F.gelu(a).add_(1)

    def step(_):
        for _ in range(20):
            optimizer.step()

    params = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)

    def clip(_):  # train_step's clipping goes through optim.clip_grads: the optimizer's share
        for _ in range(20):
            optim.clip_grads(params, 1.0, torch.tensor(1e3))

    hidden = torch.randn(64, 32, requires_grad=True)
    weight = torch.randn(4096, 32, requires_grad=True)
    target = torch.randint(0, 4000, (64,))

    def output_layer(_):
        loss, _ = cross_entropy.linear_cross_entropy(hidden, weight, target, 4000, reduction="mean")
        loss.backward()

    # besides its own: small ops (the loss's zeros, ...), and the loss's backward ends in its two leaves'
    # AccumulateGrad
    elsewhere = ("elementwise and other ops", "gradient accumulation / reduction")
    for run, cost in (
        (attention, "attention"),
        (matmuls, "other matmuls"),
        (elementwise, "elementwise and other ops"),
        (step, "optimizer"),
        (clip, "optimizer"),
        (output_layer, "output layer + loss"),
    ):
        costs = shares(run, optimizer=optimizer)
        assert costs[cost] > 0.5 and costs["other"] == 0 and costs["data wait"] == 0, (cost, costs)
        assert all(share == 0 for c, share in costs.items() if c not in (cost, *elsewhere)), (
            cost,
            costs,
        )


def test_the_named_parts_are_undone():
    optimizer, grad_norm, clip = Optimizer(), parallel.grad_norm, optim.clip_grads
    shares(lambda _: optimizer.step(), optimizer=optimizer)
    assert (
        "step" not in vars(optimizer)
        and parallel.grad_norm is grad_norm
        and optim.clip_grads is clip
    )


# -----------------------------------------------------------------------------
# bench.py on the shipped configs, its table, fp16's loss scale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A config's shape shrunk to seconds on a CPU: what bench must survive is the config's schedule and data keys
TINY = [
    "--num_layers=1",
    "--hidden_size=64",
    "--num_attention_heads=2",
    "--num_query_groups=2",
    "--seq_length=32",
    "--micro_batch_size=1",
    "--global_batch_size=2",
    "--tensor_model_parallel_size=1",
    "--pipeline_model_parallel_size=1",
    "--vocab_size=50257",
    "--fp16=false",
    "--bf16=false",
    "--device=cpu",
    "--bench_steps=1",
    "--bench_warmup=0",
]
# a new config is covered as it is added
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "config", "*.py")))


@pytest.fixture
def unmeasured_peak(monkeypatch):
    # seconds of matmuls
    monkeypatch.setattr(bench, "device_peak", lambda device, dtype: (1e12, "not measured"))


# 9-29 s on a shared 2-core CPU (about 10 s of CPU time): ten configs built and run
@pytest.mark.slow
def test_bench_runs_on_every_config(corpus, unmeasured_peak, capsys, monkeypatch):  # noqa: F811
    """Each config's schedule (warm-ups longer than the run, ramp-ups, train_samples) and data keys (no data_path,
    BLOOM's corpus and tokenizer) are set aside, with the line that says so; each gives its report and row. The
    tiny config's iteration is profiled too: each part of a real step has its share."""
    monkeypatch.chdir(ROOT)  # the bundled corpus, where the corpus fixture made it
    assert len(CONFIGS) >= 10
    for config in CONFIGS:
        profiled = config.endswith("tiny.py")
        result = bench.measure([config, *TINY] + ([] if profiled else ["--no-step_costs"]))
        out = capsys.readouterr().out
        assert "bench: timing at a constant LR = " in out, (config, out)
        for line in ("tokens/s:", "ms/iteration:", "TFLOPs:", "MFU:", "peak memory:", "data wait:"):
            assert "\n" + line in out, (config, line, out)
        assert result["skipped"] == 0 and result["tokens/s"] > 0, (config, result)
        assert bench.row(config, result).startswith(f"| {os.path.basename(config)[:-3]} | "), config
        # no data here: the bundled corpus
        if config.endswith(("gpt2_125m.py", "llama_1b.py", "tr11_176b.py")):
            assert "timing on the bundled corpus" in out, (config, out)
        if profiled:
            costs = result["costs"]
            assert list(costs) == list(bench.COSTS) and sum(costs.values()) == pytest.approx(
                1.0, abs=1e-9
            )
            for cost in (
                "output layer + loss",
                "attention",
                "other matmuls",
                "elementwise and other ops",
                "optimizer",
                "gradient accumulation / reduction",
            ):
                assert costs[cost] > 0, (cost, costs)


def test_the_schedule_is_set_aside_in_bench_only():
    cfg = arguments.load_config([os.path.join(ROOT, "config", "tr11_176b.py")])
    notes = bench.for_timing(cfg, {}, iterations=5)
    assert (
        cfg.lr_warmup_samples,
        cfg.lr_decay_samples,
        cfg.lr_decay_style,
        cfg.rampup_batch_size,
    ) == (0, None, "constant", None)
    assert (cfg.train_iters, cfg.train_samples, cfg.data_path, cfg.tokenizer_file) == (
        5,
        None,
        None,
        None,
    )
    assert (
        "rampup_batch_size=[192, 16, 9765625]" in notes[0]
        and "data/bloom/roots is not here" in notes[1]
    )
    assert (
        arguments.load_config([os.path.join(ROOT, "config", "tr11_176b.py")]).lr_warmup_samples
        == 183_105
    )
    given = arguments.load_config(["config/tiny.py", "--data_path=data/elsewhere"])
    # the user's data, as given
    assert len(bench.for_timing(given, {"data_path": "data/elsewhere"}, 5)) == 1
    assert given.data_path == ["data/elsewhere"]


def test_fp16_times_steps_that_update(corpus512, unmeasured_peak, capsys, monkeypatch):
    """From the default initial_loss_scale of 2^32 every step overflows and is skipped; bench starts at most at
    2^16 and warms up until a step updates, so that no timed step is skipped (counted, not timed)."""
    argv = [
        os.path.join(ROOT, "config", "tiny.py"),
        *TINY,
        "--fp16",
        "--vocab_size=512",
        f"--data_path={corpus512}",
        "--bench_steps=3",
        "--no-step_costs",
    ]
    result = bench.measure(argv)
    out = capsys.readouterr().out
    assert result["skipped"] == 0 and result["loss_scale"] <= 2.0**16, out
    assert (
        "loss scale:   " in out
        and "capped at 65536" in out
        and "0 of 3 timed iterations applied no update" in out
    )
    # uncapped, from 2^32: the warm-up goes on through the overflows until a step updates
    monkeypatch.setattr(bench, "TIMING_LOSS_SCALE", 2.0**32)
    result = bench.measure(argv)
    out = capsys.readouterr().out
    assert (
        result["warmup_skipped"] > 1 and result["skipped"] == 0 and result["loss_scale"] < 2.0**32
    ), out
    assert "OVERFLOW" in out and "then halved once more" in out, out


def test_telemetry_at_every_iteration_is_timed_with_it(corpus512, unmeasured_peak, capsys):
    """telemetry_interval=1 records at every timed iteration, so none is timed without it: bench divided by that
    empty list ("mean requires at least one data point"); it now times the recording iterations and says so."""
    argv = [
        os.path.join(ROOT, "config", "tiny.py"),
        *TINY,
        "--vocab_size=512",
        f"--data_path={corpus512}",
        "--bench_steps=2",
        "--no-step_costs",
        "--telemetry_interval=1",
    ]
    result = bench.measure(argv)
    out = capsys.readouterr().out
    assert (
        result["tokens/s"] > 0 and "recorded at every timed iteration (telemetry_interval=1)" in out
    ), out


# 16-28 s on a shared 2-core CPU: two processes, each importing torch, one measuring the peak
@pytest.mark.slow
def test_the_table_runs_each_config_apart_and_a_failure_loses_one_row(corpus, capfd):  # noqa: F811
    """One process per row: the tiny model's row and costs, and the broken config's error in a row of its own."""
    rows = bench.table(["config/tiny.py", "config/no_such.py", *TINY, f"--data_path={corpus}"])
    assert isinstance(rows[1][1], str) and "not found" in rows[1][1], rows
    assert sum(rows[0][1]["costs"].values()) == pytest.approx(1.0, abs=1e-9)
    out = capfd.readouterr().out
    assert "| config | " + " | ".join(bench.COSTS) + " |" in out and "\n| tiny | " in out
    assert "\n| no_such | failed: exit code 2: error: config file" in out


def test_each_gpu_sku_gets_its_own_peak():
    """MFU is against the card's own datasheet peak: an H100 PCIe (756 TFLOP/s) or NVL is not taken for the SXM
    part (989), whose name is contained in theirs; a GPU not listed is measured instead."""
    assert bench.gpu_peaks("NVIDIA H100 80GB HBM3") == (989, 3350)  # the SXM part's name
    assert bench.gpu_peaks("NVIDIA H100 PCIe") == (756, 2000)
    assert bench.gpu_peaks("NVIDIA H100 NVL") == (835, 3900)
    assert bench.gpu_peaks("NVIDIA H200") == (989, 4800)
    assert bench.gpu_peaks("NVIDIA A100-SXM4-80GB") == (312, 2039)
    assert bench.gpu_peaks("NVIDIA GeForce RTX 4090") is None


def test_cpu_vs_nanogpt_times_nanogpts_model_at_our_shape():
    """tools/cpu_vs_nanogpt.py's restatement of nanoGPT has the parameters of the GPT that bench times at the same
    shape (config/tiny.py's, less its embedding LayerNorm), one tied vocabulary table; and its step runs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "cpu_vs_nanogpt", os.path.join(ROOT, "tools", "cpu_vs_nanogpt.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    shape = [
        "--num_layers=2",
        "--hidden_size=64",
        "--num_attention_heads=4",
        "--seq_length=32",
        "--micro_batch_size=2",
    ]
    args = tool.parse([*shape, "--steps=1", "--warmup=0", "--threads=1"])
    cfg = arguments.prepare(
        arguments.load_config([os.path.join(ROOT, "config", "tiny.py"), *shape, "--train_iters=1"])
    )
    ours = build_model(cfg, CPU)
    shapes = sorted(
        tuple(p.shape) for n, p in ours.named_parameters() if not n.startswith("embed.norm.")
    )
    assert sorted(tuple(p.shape) for p in tool.nanogpt_model(args).parameters()) == shapes
    assert tool.nanogpt_tokens_per_second(args) > 0


# noqa: F811
def test_bench_counts_zeros_on_the_iterations_train_py_logs(
    corpus512, unmeasured_peak, monkeypatch
):
    """train.py counts the zero gradients (a pass over all of them, for the log) only on the iterations it logs,
    every log_interval-th; bench's iterations as many, not every one (work a training step does not do: 1-3% of
    the 6 x 384 CPU step). Iteration 1 the warm-up, 2-6 timed, 7 profiled: counted at 2, 4 and 6."""
    counted = []
    count_zeros = parallel.count_zeros
    monkeypatch.setattr(
        parallel, "count_zeros", lambda model: counted.append(1) or count_zeros(model)
    )
    bench.measure(
        [
            os.path.join(ROOT, "config", "tiny.py"),
            *TINY,
            "--vocab_size=512",
            f"--data_path={corpus512}",
            "--bench_warmup=1",
            "--bench_steps=5",
            "--log_interval=2",
        ]
    )
    assert len(counted) == 3, counted


def test_gpu_busy_is_the_union_of_the_device_kernels_and_copies():
    """bench.gpu_busy, which gives a GPU step's idle share: kernels on two streams that overlap count once, a gap
    counts as idle, and neither a range's GPU-side copy (which spans the idle time too) nor a host op counts."""
    from types import SimpleNamespace

    CUDA, HOST = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device, start, end, annotation=False):
        return SimpleNamespace(
            name=name,
            device_type=device,
            is_user_annotation=annotation,
            time_range=SimpleNamespace(start=start, end=end),
        )

    events = [
        event("bench: step", HOST, 0, 100, annotation=True),
        event("bench: step", CUDA, 0, 100, annotation=True),  # the range on the GPU's timeline
        event("bench: optimizer", HOST, 60, 90, annotation=True),
        event("bench: optimizer", CUDA, 60, 90),  # flagged or not, named as a host range: left out
        event("aten::mm", HOST, 0, 3),
        event("sm90_xmma_gemm", CUDA, 0, 10),
        event("triton_poi_fused_add", CUDA, 5, 20),  # two streams
        event("Memcpy HtoD", CUDA, 20, 25),
        event("triton_red_fused_sum", CUDA, 30, 40),
    ]
    assert bench.gpu_busy(events) == 35.0  # [0, 25) and [30, 40)
    assert bench.gpu_busy([e for e in events if e.device_type == HOST]) == 0.0


# -----------------------------------------------------------------------------
# the spike guard's price (--guard_price)


def test_a_guarded_run_calls_the_stability_layer_at_train_py_s_points(
    corpus512,
    unmeasured_peak,
    capsys,
    monkeypatch,  # noqa: F811
):
    """With --spike_guard each iteration bench times passes the callbacks' points of train.py's
    loop, in its order, after one start: what the guard costs is in the time. Without it none is
    built."""
    import builders

    points = ("start", "before_step", "check_step", "after_step", "after_iteration")
    calls, real = [], builders.build_callbacks

    def spied(cfg, *args, **kwargs):
        callbacks = real(cfg, *args, **kwargs)
        for point in points:
            method = getattr(callbacks, point)
            monkeypatch.setattr(
                callbacks,
                point,
                lambda *a, _m=method, _p=point, **k: calls.append(_p) or _m(*a, **k),
            )
        return callbacks

    monkeypatch.setattr(builders, "build_callbacks", spied)
    argv = [
        os.path.join(ROOT, "config", "tiny.py"),
        *TINY,
        "--vocab_size=512",
        f"--data_path={corpus512}",
        "--bench_steps=2",
        "--bench_warmup=1",
        "--no-step_costs",
    ]
    bench.measure(argv)
    assert calls == []  # no switch on: NO_CALLBACKS, no point called
    result = bench.measure(argv + ["--spike_guard"])
    assert result["iterations"] == 3 and calls == ["start"] + list(points[1:]) * 3, calls


def test_guard_price_prints_the_ratio_of_the_guarded_run_to_the_plain_one(monkeypatch, capsys):
    runs = []

    def measured(config, others):
        runs.append(others)
        guarded = "--spike_guard" in others
        return {"tokens/s": 990.0 if guarded else 1000.0, "steps": 10, "iterations": 13}

    monkeypatch.setattr(bench, "measure_apart", measured)
    bench.main(["config/gpt2_125m.py", "--guard_price", "--bench_steps=10", "--bench_warmup=3"])
    assert runs == [
        ["--bench_steps=10", "--bench_warmup=3"],
        ["--bench_steps=10", "--bench_warmup=3", "--spike_guard"],
    ]
    line = capsys.readouterr().out.strip()
    assert line.startswith(
        "guard: gpt2_125m 990.0 tokens/s with --spike_guard at its defaults, 1,000.0 without: "
        "ratio 0.990 (means of 10 timed iterations each"
    ), line
    assert "snapshots every 50 iterations: none in these 13, their cost not in the ratio" in line
    assert line.endswith(
        "; the guard arms after 16 steps: unarmed in these, its checks' forwards "
        "not in the ratio; goal >= 0.99)"
    ), line
    with pytest.raises(ValueError, match="--guard_price times one CONFIG.py"):
        bench.main(["config/gpt2_125m.py", "--guard_price", "--spike_guard"])


def test_on_the_cpu_bench_says_what_the_iterations_will_cost_before_running_them(monkeypatch):
    """gpt2_125m at its real widths (1 layer, 2 x 128 tokens): the model FLOPs of the iterations at
    CPU_MFU of the CPU's matmul rate, stated before any is built or run."""
    monkeypatch.setattr(
        bench, "measured_peak", lambda device, dtype, n, repeats=10: 2e10
    )  # 20 GFLOP/s, "measured"
    cfg = arguments.load_config(
        [
            os.path.join(ROOT, "config", "gpt2_125m.py"),
            "--num_layers=1",
            "--seq_length=128",
            "--micro_batch_size=1",
            "--global_batch_size=2",
            "--use_bundled_corpus",
        ]
    )
    arguments.prepare(cfg, 1)
    flops = (
        2 * 128 * (6 * (12 * 768**2 + 50257 * 768) + 12 * 768 * 128)
    )  # PaLM's 6N + 12 n h s per token
    line = bench.cpu_cost_note(cfg, 3, torch.device("cpu"))
    assert line.startswith(
        f"bench: on the CPU, 3 iteration(s) of {flops / 1e9:,.1f} GFLOP (the model's) at 20.0 "
        f"GFLOP/s (bfloat16 1024^3 matmul here): about {3 * flops / (0.05 * 2e10):,.0f} s at "
        "the ~5% MFU"
    ), line


def test_result_json_is_checked_before_the_measurement_and_written_whole_over_its_own_only(
    tmp_path, monkeypatch
):
    def unmeasured(argv):
        raise AssertionError("measured before --result_json was checked")

    monkeypatch.setattr(bench, "measure", unmeasured)
    notes = tmp_path / "keep.json"
    notes.write_text('{"a user": "file"}\n')
    for path, said in [
        (notes, "exists and is not bench's numbers"),
        (notes / "r.json", "keep.json is a file, not a directory"),
        (tmp_path, "is a directory"),
    ]:
        with pytest.raises(ValueError, match=said):
            bench.main(["config/tiny.py", f"--result_json={path}"])
    assert notes.read_text() == '{"a user": "file"}\n'
    numbers = {"tokens/s": 1.0, "TFLOPs": 2.0, "MFU": 0.1, "layout": "x", "mean": 1, "best": 1}
    monkeypatch.setattr(bench, "measure", lambda argv: dict(numbers))
    path = tmp_path / "r.json"
    bench.main(["config/tiny.py", f"--result_json={path}"])
    numbers["tokens/s"] = 3.0
    bench.main(["config/tiny.py", f"--result_json={path}"])  # a rerun: its own file written over
    assert json.loads(path.read_text()) == numbers
    assert sorted(os.listdir(tmp_path)) == ["keep.json", "r.json"]  # no temporary file left
