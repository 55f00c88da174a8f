"""DeepSpeed (deepspeed_engine.py) trains as the native path does.

One process group per world size (2 and 4 gloo processes) runs train.main over several layouts in turn: native
bf16 and DeepSpeed bf16 at each ZeRO stage allowed, 10 iterations each, compared in the workers: lm loss and
grad norm within 5e-3 relative at every iteration, Adam's step counter at 10, the two copies of the tied
embedding and every replica (TP-replicated parameters, DP ranks) bitwise equal. The native bf16 run is whatever
the native bf16 path is when the test runs. Then: DeepSpeed's bf16 gradients accumulate in fp32, the refusals
(fp16, bitsandbytes, ...) and, end to end through torchrun, the fp32 ZeRO-1 run against one process and an
exact resume with the step counter saved.
"""
import contextlib
import io
import math
import os

import pytest
import torch
import torch.distributed as dist

import parallel
from test_parallel import corpus  # noqa: F401 (the synthetic corpus fixture)
from test_parallel import E2E_ARGS, assert_replicas_identical, assert_same_training, dumps, spawn, train

E2E = [a for a in E2E_ARGS if not a.startswith(("--save", "--save_interval"))] + ["--save_interval=none", "--bf16"]


class Recorder:
    """train.main with spies on what it builds and on every train_step's (loss, grad norm, outcome)."""

    def __init__(self):
        import train
        import deepspeed_engine
        self.train, self.steps, self.model, self.optimizer, self.ds = train, [], None, None, None
        self.originals = {"train_step": train.train_step, "build_model": train.build_model,
                          "build_optimizer": train.build_optimizer}
        self.ds_class = deepspeed_engine.DeepSpeedOptimizer

    def run(self, *args):
        train, rec = self.train, self
        rec.steps, rec.ds = [], None

        def train_step(*a, **k):
            out = rec.originals["train_step"](*a, **k)
            rec.steps.append((out[0], out[1], out[3]))
            return out

        def build_model(*a, **k):
            rec.model = rec.originals["build_model"](*a, **k)
            return rec.model

        def build_optimizer(*a, **k):
            rec.optimizer = rec.originals["build_optimizer"](*a, **k)
            return rec.optimizer

        class Spy(self.ds_class):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                rec.ds = self

        import deepspeed_engine
        train.train_step, train.build_model, train.build_optimizer = train_step, build_model, build_optimizer
        deepspeed_engine.DeepSpeedOptimizer = Spy
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                train.main([*E2E, *args])
        finally:
            for name, fn in self.originals.items():
                setattr(train, name, fn)
            deepspeed_engine.DeepSpeedOptimizer = self.ds_class
        return self.steps


def _gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _check_replicas(model, what):
    """Bitwise: the tied embedding's two copies, TP-replicated parameters across TP, everything across DP."""
    g = parallel.grid
    if g.pp_size > 1 and (g.is_first_stage or g.is_last_stage):
        first, last = _gather(parallel.tied_embedding(model).detach(), g.embedding_group)
        assert torch.equal(first, last), f"{what}: the tied embedding's copies differ"
    for name, p in model.named_parameters():
        if getattr(p, "tp_dim", None) is None and g.tp_size > 1:
            assert all(torch.equal(q, p) for q in _gather(p.detach(), g.tp_group)), f"{what}: {name} across TP"
        if g.dp_size > 1:
            assert all(torch.equal(q, p) for q in _gather(p.detach(), g.dp_group)), f"{what}: {name} across DP"


def _matrix(corpus, layouts):
    """For each (TP, PP, zero stages): native bf16, then DeepSpeed bf16 at each stage, against it."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    rec = Recorder()
    for tp, pp, stages in layouts:
        layout = [f"--data_path={corpus}", f"--tensor_model_parallel_size={tp}",
                  f"--pipeline_model_parallel_size={pp}"]
        native = rec.run(*layout)
        assert len(native) == 10 and all(outcome == "ok" for *_, outcome in native)
        for zero in stages:
            what = f"TP={tp} PP={pp} DeepSpeed zero_stage={zero}"
            steps = rec.run(*layout, "--deepspeed", f"--zero_stage={zero}")
            assert len(steps) == 10, what
            for it, ((loss, norm, outcome), (ref_loss, ref_norm, _)) in enumerate(zip(steps, native), 1):
                assert outcome == "ok", (what, it)
                assert math.isclose(loss, ref_loss, rel_tol=5e-3), f"{what} iteration {it}: lm loss {loss} vs {ref_loss}"
                assert math.isclose(norm, ref_norm, rel_tol=5e-3), f"{what} iteration {it}: grad norm {norm} vs {ref_norm}"
            assert rec.model.embed is None or rec.model.embed.word.weight.dtype == torch.bfloat16
            # Adam's step counter: 10 updates, none made by DeepSpeed at construction
            states = list(rec.optimizer.state.values())
            assert states and all(int(s["step"]) == 10 for s in states), (what, [s["step"] for s in states])
            _check_replicas(rec.model, what)
    return rec


def _world2(corpus):
    rec = _matrix(corpus, [(1, 1, (0, 1, 2)), (2, 1, (0, 1, 2)), (1, 2, (0, 1))])
    _accumulates_in_fp32(rec)


def _world4(corpus):
    _matrix(corpus, [(2, 2, (0, 1)), (1, 2, (0, 1))])  # TP2 x PP2, PP2 x DP2


def _accumulates_in_fp32(rec):
    """BF16_Optimizer (the last run: PP=2, zero_stage=1) adds each micro-batch's bf16 gradient into an fp32
    buffer: after 64 micro-batches it holds their sum to fp32 rounding, where a bf16 running sum is far off."""
    import train
    ds, model = rec.ds, rec.model
    assert type(ds.optimizer).__name__ == "BF16_Optimizer" and ds.engine.communication_data_type == torch.float32
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (64, 2, 33), generator=gen)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    args = train.arguments.load_config([*E2E, "--pipeline_model_parallel_size=2"])
    params = [p for p in model.parameters()]
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    running = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]
    for batch in batches:  # one micro-batch at a time: its bf16 gradient, exactly, in the fp32 buffer
        ds.zero_grad()
        train.forward_backward(model, [batch], args, torch.device("cpu"))
        for e, r, p in zip(exact, running, params):
            e += ds.gradient(p).double() / len(batches)
            r += (ds.gradient(p) / len(batches)).bfloat16()
    ds.zero_grad()
    train.forward_backward(model, batches, args, torch.device("cpu"))
    for name, e, r, p in zip([n for n, _ in model.named_parameters()], exact, running, params):
        got = ds.gradient(p).double()
        assert ds.gradient(p).dtype == torch.float32
        scale = e.abs().max().item()
        assert (got - e).abs().max().item() <= 1e-5 * scale, name
    errors = [((r.double() - e).abs().max() / e.abs().max()).item() for e, r in zip(exact, running)]
    assert max(errors) > 1e-3  # what bf16 accumulation would have lost: the check above can tell


@pytest.mark.slow
def test_deepspeed_bf16_matches_native_dp2_tp2_pp2(corpus):
    spawn(_world2, 2, 1, 1, corpus)


@pytest.mark.slow
def test_deepspeed_bf16_matches_native_tp2xpp2_pp2xdp2(corpus):
    spawn(_world4, 4, 1, 1, corpus)
