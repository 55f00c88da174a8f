"""DeepSpeed (deepspeed_engine.py) trains as the native path does.

One process group per world size (2 and 4 gloo processes) runs train.py's main over several layouts in turn, which pays
DeepSpeed's import and the process start-up once: for each layout the native run, then DeepSpeed at each ZeRO stage
allowed, 10 iterations each, compared inside the workers -- lm loss and grad norm at every iteration (relative: the
README's 6e-5 and 7e-4 under bf16, 1e-5 under fp32), Adam's step counter at 10, the two copies of the tied
embedding and every replica (TP-replicated parameters, DP ranks) bitwise equal. The native bf16 reference is itself
held to one process by tests/test_parallel.py (half-precision layouts). Then, in the same processes: DeepSpeed's
bf16 gradients accumulate in fp32 over 64 micro-batches, a DeepSpeed bf16 run saved at iteration 5 resumes
bit-exactly with its step counter, and PP=2 with an untied output layer trains as the native path. One process
(python train.py --deepspeed) gets a one-process group and trains as the native path. The refusals (fp16,
bitsandbytes, ...) are checked without starting DeepSpeed.
"""

import contextlib
import io
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import parallel
from helpers import E2E_ARGS, ROOT, gather, spawn, synthetic_corpus, train_script  # noqa: F401 (a fixture)
from optim import OptimizerConfig
from sections import section

# --save=none: a run that saves passes --save=DIR after it (the later value wins)
E2E = list(E2E_ARGS)
# DeepSpeed bf16 against native bf16, lm loss and grad norm: the README's figures
BF16_REL = (6e-5, 7e-4)


class Recorder:
    """train.py's main, with spies on the model and optimizer it builds and on each
    training.train_step's (loss, grad norm, outcome)."""

    def __init__(self):
        import deepspeed.runtime.bf16_optimizer

        import builders
        import deepspeed_engine

        # BF16_Optimizer reports memory at construction with six forced gc.collect() (1 s each in a test
        # process's heap) and prints it: nothing the comparisons need
        deepspeed.runtime.bf16_optimizer.see_memory_usage = lambda *args, **kwargs: None
        import optim
        import training

        self.main, self.deepspeed_engine = train_script()["main"], deepspeed_engine
        # where train.py finds them: the modules of the step, the builders and the optimizer
        self.owners = {
            "train_step": vars(training),
            "build_model": vars(builders),
            "optimizer_for": vars(optim),
        }
        self.originals = {name: owner[name] for name, owner in self.owners.items()}
        self.wrapper_class = deepspeed_engine.DeepSpeedOptimizer
        self.steps, self.model, self.optimizer, self.wrapper = [], None, None, None

    def run(self, *args):
        rec = self
        rec.steps, rec.wrapper = [], None

        def train_step(*a, **k):
            out = rec.originals["train_step"](*a, **k)
            rec.steps.append((out[0], out[1], out[3]))
            return out

        def build_model(*a, **k):
            rec.model = rec.originals["build_model"](*a, **k)
            return rec.model

        def optimizer_for(*a, **k):
            rec.optimizer = rec.originals["optimizer_for"](*a, **k)
            return rec.optimizer

        class Wrapper(self.wrapper_class):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                rec.wrapper = self

            def close(self):  # the engine stays alive after the run: the checks below still use it
                pass

        for name, fn in (
            ("train_step", train_step),
            ("build_model", build_model),
            ("optimizer_for", optimizer_for),
        ):
            self.owners[name][name] = fn
        self.deepspeed_engine.DeepSpeedOptimizer = Wrapper
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                self.main([*E2E, *args])
        finally:
            for name, fn in self.originals.items():
                self.owners[name][name] = fn
            self.deepspeed_engine.DeepSpeedOptimizer = self.wrapper_class
        return self.steps


def _check_replicas(model, what):
    """Bitwise: the tied embedding's two copies, TP-replicated parameters across TP, everything across DP."""
    g = parallel.grid
    tied = not model.config.untie_embeddings_and_output_weights
    if tied and g.pp_size > 1 and (g.is_first_stage or g.is_last_stage):
        first, last = gather(model.word_embedding_weight().detach(), g.embedding_group)
        assert torch.equal(first, last), f"{what}: the tied embedding's two copies differ"
    for name, p in model.named_parameters():
        if getattr(p, "tp_dim", None) is None and g.tp_size > 1:
            assert all(torch.equal(q, p) for q in gather(p.detach(), g.tp_group)), (
                f"{what}: {name} across TP"
            )
        if g.dp_size > 1:
            assert all(torch.equal(q, p) for q in gather(p.detach(), g.dp_group)), (
                f"{what}: {name} across DP"
            )


def _matrix(rec, synthetic_corpus, layouts, extra=()):
    """layouts: (TP, PP, {precision: zero stages}). Per layout and precision: the native run, then DeepSpeed
    at each stage against it; extra: more flags for every run. Prints the worst relative differences (pytest -s
    shows them)."""
    for tp, pp, runs in layouts:
        layout = [
            f"--data_path={synthetic_corpus}",
            f"--tensor_model_parallel_size={tp}",
            f"--pipeline_model_parallel_size={pp}",
            *extra,
        ]
        for precision, stages in runs.items():
            flags = ["--bf16"] if precision == "bf16" else []
            rel = BF16_REL if precision == "bf16" else (1e-5, 1e-5)
            native = rec.run(*layout, *flags)
            assert len(native) == 10 and all(outcome == "ok" for *_, outcome in native)
            for zero in stages:
                what = f"TP={tp} PP={pp} DP={parallel.grid.dp_size} {precision} DeepSpeed zero_stage={zero}"
                steps = rec.run(*layout, *flags, "--deepspeed", f"--zero_stage={zero}")
                assert len(steps) == 10, what
                worst = [0.0, 0.0]
                for it, (got, ref) in enumerate(zip(steps, native), 1):
                    assert got[2] == "ok", (what, it)
                    for k, name in enumerate(("lm loss", "grad norm")):
                        assert math.isclose(got[k], ref[k], rel_tol=rel[k]), (
                            f"{what} iteration {it}: {name} {got[k]} vs {ref[k]} (native)"
                        )
                        worst[k] = max(worst[k], abs(got[k] - ref[k]) / abs(ref[k]))
                if precision == "bf16":
                    assert next(rec.model.parameters()).dtype == torch.bfloat16, what
                # Adam's step counter: 10 updates, none made by DeepSpeed at construction
                states = list(rec.optimizer.state.values())
                assert states and all(int(s["step"]) == 10 for s in states), (
                    what,
                    [s["step"] for s in states],
                )
                _check_replicas(rec.model, what)
                if parallel.grid.rank == 0:
                    print(
                        f"{what}: worst relative difference to native over 10 iterations: lm loss {worst[0]:.1e},"
                        f" grad norm {worst[1]:.1e}",
                        file=sys.stderr,
                        flush=True,
                    )


def _world2(synthetic_corpus, tmp):
    os.environ["DS_ACCELERATOR"] = "cpu"
    rec = Recorder()
    _matrix(
        rec,
        synthetic_corpus,
        [
            (1, 1, {"bf16": (0, 1, 2)}),  # DP=2
            (2, 1, {"bf16": (0, 1, 2), "fp32": (1, 2)}),  # TP=2
            (1, 2, {"bf16": (0, 1)}),
        ],
    )  # PP=2: the last run, resumed below
    full = rec.steps
    _accumulates_in_fp32(rec)
    _resumes_exactly(rec, synthetic_corpus, tmp, full)
    _untied_pp2(rec, synthetic_corpus)


def _world4(synthetic_corpus):
    os.environ["DS_ACCELERATOR"] = "cpu"
    _matrix(
        Recorder(),
        synthetic_corpus,
        [
            (2, 2, {"bf16": (0, 1)}),  # TP=2 x PP=2
            (1, 2, {"bf16": (0, 1)}),
        ],
    )  # PP=2 x DP=2


def _accumulates_in_fp32(rec):
    """BF16_Optimizer adds each micro-batch's bf16 gradient into an fp32 buffer: after 64 micro-batches the
    buffer holds their sum to fp32 rounding, where a bf16 running sum is off by more than 1e-3."""
    import arguments
    import loader
    from training import forward_backward

    wrapper, model = rec.wrapper, rec.model
    assert type(wrapper.optimizer).__name__ == "BF16_Optimizer"
    # the DP all-reduce of the fp32 buffers
    assert wrapper.engine.communication_data_type == torch.float32
    cfg = arguments.load_config([*E2E, "--bf16", "--pipeline_model_parallel_size=2"])
    tokens = torch.randint(0, 512, (64, 2, 33), generator=torch.Generator().manual_seed(0))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    params = list(model.parameters())
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    running = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]
    for (
        batch
    ) in batches:  # one micro-batch at a time: its own bf16 gradient, exactly, in the fp32 buffer
        wrapper.zero_grad()
        forward_backward(model, [batch], loader.packing(cfg), torch.device("cpu"))
        for e, r, p in zip(exact, running, params):
            g = wrapper.gradient(p) / len(batches)  # a power of two: exact
            e += g.double()
            r += g.bfloat16()
    wrapper.zero_grad()
    forward_backward(model, batches, loader.packing(cfg), torch.device("cpu"))
    for (name, p), e in zip(model.named_parameters(), exact):
        got = wrapper.gradient(p)
        assert got.dtype == torch.float32, name
        assert (got.double() - e).abs().max() <= 1e-5 * e.abs().max(), name
    assert (
        max(((r.double() - e).abs().max() / e.abs().max()).item() for e, r in zip(exact, running))
        > 1e-3
    )
    wrapper.zero_grad()


def _resumes_exactly(rec, synthetic_corpus, tmp, full):
    """PP=2, DeepSpeed bf16 ZeRO-1: 5 iterations, save, resume for 5 more: the same numbers bit for bit as the
    uninterrupted run (`full`), the fp32 master weights and Adam's step counter from the rank files, and every
    stage's weights the same after the load as before the save."""
    args = [
        f"--data_path={synthetic_corpus}",
        "--bf16",
        "--deepspeed",
        "--zero_stage=1",
        "--pipeline_model_parallel_size=2",
        f"--save={tmp}",
        "--dump_weights",
    ]
    assert rec.run(*args, "--exit_interval=5") == full[:5]
    steps = torch.load(
        os.path.join(tmp, "global_step5", f"rank_{parallel.grid.rank:05d}_optim_states.pt"),
        weights_only=False,
    )["optimizer"]["base_optimizer_state"]["state"]
    assert steps and all(int(s["step"]) == 5 for s in steps.values())
    assert rec.run(*args, f"--load={tmp}") == full[5:]
    dist.barrier()
    if parallel.grid.rank == 0:
        check = subprocess.run(
            [sys.executable, "tools/compare_weight_dumps.py", tmp],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert check.returncode == 0 and "2 of 2 rank(s) identical" in check.stdout, (
            check.stdout + check.stderr
        )


@pytest.mark.slow
def test_deepspeed_matches_native_dp2_tp2_pp2_and_resumes_exactly(synthetic_corpus, tmp_path):
    """... and PP=2 with an untied output layer (_untied_pp2)."""
    spawn(_world2, 2, 1, 1, synthetic_corpus, str(tmp_path))


@pytest.mark.slow
def test_deepspeed_bf16_matches_native_tp2xpp2_pp2xdp2(synthetic_corpus):
    spawn(_world4, 4, 1, 1, synthetic_corpus)


def _untied_pp2(rec, synthetic_corpus):
    """An untied output layer lives on the last stage alone: no tied-embedding sum across the stages (which had
    no second copy to sum with), and DeepSpeed trains as the native path (in _world2's processes: a spawn of its
    own cost as much as its three runs again)."""
    _matrix(
        rec, synthetic_corpus, [(1, 2, {"bf16": (0, 1)})], ["--untie_embeddings_and_output_weights"]
    )


def _one_process(synthetic_corpus):
    os.environ["DS_ACCELERATOR"] = "cpu"
    assert not dist.is_initialized()
    rec = Recorder()
    native = rec.run(f"--data_path={synthetic_corpus}", "--bf16", "--train_iters=3")
    steps = rec.run(
        f"--data_path={synthetic_corpus}",
        "--bf16",
        "--train_iters=3",
        "--deepspeed",
        "--zero_stage=1",
    )
    assert len(steps) == len(native) == 3
    for got, ref in zip(steps, native):
        assert got[2] == "ok", got
        assert math.isclose(got[0], ref[0], rel_tol=BF16_REL[0]), (got, ref)
        assert math.isclose(got[1], ref[1], rel_tol=BF16_REL[1]), (got, ref)


@pytest.mark.slow
def test_deepspeed_in_one_process(synthetic_corpus):
    """python train.py --deepspeed (no torchrun): a one-process group is made for DeepSpeed, and the run is
    the native one."""
    spawn(_one_process, 1, 1, 1, synthetic_corpus)


# -----------------------------------------------------------------------------
# What DeepSpeed does not run as the native path would: one message each, before DeepSpeed is imported


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fp16"], "deepspeed=True with fp16 is not supported"),
        (
            ["--bf16", "--use_bnb_optimizer"],
            "use_bnb_optimizer with deepspeed=True is not supported",
        ),
        (["--bf16", "--zero_stage=3"], "zero_stage=3 is not supported"),
        (
            ["--bf16", "--zero_stage=2", "--pipeline_model_parallel_size=2"],
            "zero_stage=2 with pipeline",
        ),
        (["--zero_stage=0"], "zero_stage=0 and fp32 adds nothing"),
        (
            ["--bf16", "--skip_grad_norm_above=1.0"],
            "skip_grad_norm_above needs the grad norm before the update",
        ),
    ],
)
def test_deepspeed_refuses_what_it_would_get_wrong(flags, message):
    import arguments
    import deepspeed_engine

    cfg = arguments.load_config(["--deepspeed", "--zero_stage=1", *flags])
    grid = parallel.Grid(
        1, cfg.pipeline_model_parallel_size, world_size=cfg.pipeline_model_parallel_size * 2
    )
    with pytest.raises(ValueError, match=message):
        deepspeed_engine.check(section(OptimizerConfig, cfg), cfg.zero_stage, grid)


def test_deepspeed_bf16_zero0_is_bf16_optimizer_like_zero1():
    """DeepSpeed 0.19 has fp32 gradient accumulation for bf16 only in BF16_Optimizer, which it builds for
    ZeRO-1: zero_stage=0 is given the same configuration (and a line at start says so)."""
    import arguments
    import deepspeed_engine

    grid = parallel.Grid(1, 1, world_size=2)
    cfg = arguments.load_config(["--deepspeed", "--bf16"])
    optim_cfg = section(OptimizerConfig, cfg)
    config = {
        z: deepspeed_engine.ds_config(optim_cfg, z, grid, cfg.micro_batch_size) for z in (0, 1, 2)
    }
    assert config[0] == config[1] and config[1]["zero_optimization"]["stage"] == 1
    assert (
        config[1]["data_types"] == {"grad_accum_dtype": "fp32"}
        and config[1]["communication_data_type"] == "fp32"
    )
    assert (
        config[1]["bf16"]["immediate_grad_update"]
        and not config[2]["bf16"]["immediate_grad_update"]
    )


@pytest.mark.parametrize(
    "flag, message",
    [
        (
            "--spike_guard",
            "spike_guard judges the loss and grad norm before the update, which DeepSpeed computes inside "
            "its step(); set spike_guard=False or deepspeed=False",
        ),
        ("--telemetry_interval=10", "telemetry_interval needs the gradients before the update"),
    ],
)
def test_spike_guard_and_telemetry_are_refused_under_deepspeed(flag, message):
    """What needs the loss or the gradients before the update cannot run inside DeepSpeed's step (README)."""
    import arguments

    with pytest.raises(ValueError, match=re.escape(message)):
        arguments.validate(
            arguments.load_config(["--deepspeed", "--bf16", "--zero_stage=1", flag]), world_size=1
        )
    # the native path takes it
    arguments.validate(arguments.load_config(["--bf16", flag]), world_size=1)
