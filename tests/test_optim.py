"""Tests for optim.py: AdamW against torch.optim.AdamW, the step counter across save/load (lesson 7),
8-bit Adam, gradient utilities against torch.nn.utils, the lr schedule against hand computations from
lesson 23 and the tr8b-104B logs, and the fp16 loss scaler against lesson 5's OVERFLOW lines."""

import io
import math

import pytest
import torch

import optim
import parallel
from optim import AdamW, LossScaler
from schedule import AnnealingLR


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 16),
        torch.nn.Linear(16, 32),
        torch.nn.LayerNorm(32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 50),
    )


def _loss(model, gen):
    x = torch.randint(0, 50, (8, 6), generator=gen)
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.view(-1, 50), x.roll(1, dims=1).view(-1))


def _train(model, opt, steps, gen, lrs=None):
    for i in range(steps):
        if lrs is not None:
            optim.set_lr(opt, lrs[i])
        opt.zero_grad(set_to_none=True)
        _loss(model, gen).backward()
        opt.step()


def _roundtrip(obj):
    """torch.save -> torch.load(weights_only=True), as a checkpoint does."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


# -----------------------------------------------------------------------------
# AdamW


def test_adamw_matches_torch_adamw_with_groups_and_changing_lr():
    ours, ref = _mlp(), _mlp()
    opt = AdamW(
        optim.param_groups(ours, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    ref_opt = torch.optim.AdamW(
        optim.param_groups(ref, 0.1),
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        fused=True,
    )
    assert [g["name"] for g in opt.param_groups] == ["decay", "no_decay"]
    sched = AnnealingLR(1e-2, 1e-3, "cosine", warmup_samples=40, decay_samples=240)
    # warm-up, then decay: changes every step
    lrs = [sched.get_lr(8 * (i + 1), 0) for i in range(30)]
    assert len(set(lrs)) == 30
    _train(ours, opt, 30, torch.Generator().manual_seed(1), lrs)
    _train(ref, ref_opt, 30, torch.Generator().manual_seed(1), lrs)

    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)  # bitwise: the same fused kernel
        s, t = opt.state[p], ref_opt.state[q]
        assert s["step"] == int(t["step"]) == 30
        assert torch.equal(s["exp_avg"], t["exp_avg"])
        assert torch.equal(s["exp_avg_sq"], t["exp_avg_sq"])
    # and the weights did move
    assert not torch.equal(next(ours.parameters()), next(_mlp().parameters()))


def test_step_counter_survives_save_and_load():
    model = _mlp()
    opt = AdamW(optim.param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    _train(model, opt, 12, torch.Generator().manual_seed(2))

    sd = _roundtrip({"model": model.state_dict(), "optim": opt.state_dict()})
    assert all(s["step"] == 12 for s in sd["optim"]["state"].values())
    resumed = _mlp(seed=99)
    resumed.load_state_dict(sd["model"])
    resumed_opt = AdamW(
        optim.param_groups(resumed, 0.1), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1
    )
    resumed_opt.load_state_dict(sd["optim"])

    _train(model, opt, 3, torch.Generator().manual_seed(3))
    _train(resumed, resumed_opt, 3, torch.Generator().manual_seed(3))
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert all(s["step"] == 15 for s in resumed_opt.state.values())


def test_step_reset_inflates_updates_by_the_bias_correction_ratio():
    # lesson 7: a resume that restarts the counter (apex FusedAdam) divides long-run moments by a
    # bias correction meant for fresh ones; update ratio sqrt(1 - b2^k) / (1 - b1^k) at restarted step k
    beta1, beta2, steps = 0.9, 0.95, 300
    # fp64: exact update differences
    w = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.float64))
    opt = AdamW([w], lr=1e-3, betas=(beta1, beta2), eps=1e-12)
    for i in range(steps):
        _set_grads([w], seed=i)
        opt.step()

    def run_from(reset_step):
        p = torch.nn.Parameter(w.detach().clone())
        o = AdamW([p], lr=1e-3, betas=(beta1, beta2), eps=1e-12)
        o.load_state_dict(_roundtrip(opt.state_dict()))  # its own copy: loading aliases the tensors
        if reset_step:
            o.state[p]["step"] = 0  # the bug: moments restored, counter not
        deltas = []
        for i in range(5):
            before = p.detach().clone()
            _set_grads([p], seed=1000 + i)
            o.step()
            deltas.append(p.detach() - before)
        return deltas

    good, reset = run_from(False), run_from(True)
    ratios = []
    for k in range(1, 6):
        expected = (math.sqrt(1 - beta2**k) / (1 - beta1**k)) / (
            math.sqrt(1 - beta2 ** (steps + k)) / (1 - beta1 ** (steps + k))
        )
        ratio = reset[k - 1] / good[k - 1]
        torch.testing.assert_close(ratio, torch.full_like(ratio, expected), rtol=1e-6, atol=0)
        ratios.append(expected)
    # the chronicle's "2.2x - 1.15x for the first 5 iterations"
    assert 2.2 < ratios[0] < 2.25 and 1.15 < ratios[4] < 1.17


def test_lr_zero_keeps_weights_bit_identical_and_warms_up_the_moments():
    model = _mlp()
    opt = AdamW(optim.param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    _train(model, opt, 3, torch.Generator().manual_seed(4))
    weights = [p.detach().clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]

    optim.set_lr(opt, 0.0)
    _train(model, opt, 5, torch.Generator().manual_seed(5))
    for p, w, v in zip(model.parameters(), weights, moments):
        assert torch.equal(p, w)
        assert not torch.equal(opt.state[p]["exp_avg_sq"], v)
        assert opt.state[p]["step"] == 8

    # lesson 8's reset: a fresh optimizer, N = 5 / (1 - beta2) = 100 steps at lr 0
    fresh = AdamW(optim.param_groups(model, 0.1), lr=0.0, betas=(0.9, 0.95), weight_decay=0.1)
    _train(model, fresh, 100, torch.Generator().manual_seed(6))
    for p, w in zip(model.parameters(), weights):
        assert torch.equal(p, w)
        assert fresh.state[p]["step"] == 100


def test_param_groups_follow_megatrons_rule():
    model = _mlp()
    emb, lin1, ln, _, lin2 = model
    groups = optim.param_groups(model, 0.05)
    by_name = {g["name"]: g for g in groups}
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(by_name["decay"]["params"]) == ids([emb.weight, lin1.weight, lin2.weight])
    assert ids(by_name["no_decay"]["params"]) == ids([lin1.bias, ln.weight, ln.bias, lin2.bias])
    assert by_name["decay"]["weight_decay"] == 0.05 and by_name["no_decay"]["weight_decay"] == 0.0
    # empty groups are left out
    assert [g["name"] for g in optim.param_groups(torch.nn.LayerNorm(4), 0.1)] == ["no_decay"]
    assert isinstance(optim.build_optimizer(model, 1e-3, 0.1, 0.9, 0.95, 1e-8), AdamW)


# -----------------------------------------------------------------------------
# bitsandbytes 8-bit AdamW


def _bnb_model(seed=0):
    torch.manual_seed(seed)
    # 16384 + 256 params
    return torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256))


def _bnb_loss(model, gen):
    x = torch.randint(0, 256, (32,), generator=gen)
    return torch.nn.functional.cross_entropy(model(x), (x * 7 + 3) % 256)  # learnable map


def _bnb_train(model, opt, steps, gen):
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = _bnb_loss(model, gen)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_bnb_8bit_trains_keeps_embedding_32bit_and_resumes_exactly():
    pytest.importorskip("bitsandbytes")
    model = _bnb_model()
    opt = optim.build_optimizer(
        model, 3e-3, 0.01, 0.9, 0.95, 1e-8, use_bnb_optimizer=True, embedding=model[0].weight
    )
    assert type(opt).__name__ == "AdamW8bit"
    losses = _bnb_train(model, opt, 60, torch.Generator().manual_seed(7))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5

    emb_state, lin_state = opt.state[model[0].weight], opt.state[model[1].weight]
    assert emb_state["state1"].dtype == emb_state["state2"].dtype == torch.float32
    assert lin_state["state1"].dtype == lin_state["state2"].dtype == torch.uint8
    assert emb_state["step"] == lin_state["step"] == 60

    sd = _roundtrip({"model": model.state_dict(), "optim": opt.state_dict()})
    resumed = _bnb_model(seed=123)
    resumed.load_state_dict(sd["model"])
    resumed_opt = optim.build_optimizer(
        resumed, 3e-3, 0.01, 0.9, 0.95, 1e-8, use_bnb_optimizer=True, embedding=resumed[0].weight
    )
    resumed_opt.load_state_dict(sd["optim"])
    _bnb_train(model, opt, 2, torch.Generator().manual_seed(8))
    _bnb_train(resumed, resumed_opt, 2, torch.Generator().manual_seed(8))
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        assert opt.state[p]["step"] == resumed_opt.state[q]["step"] == 62
    assert resumed_opt.state[resumed[0].weight]["state1"].dtype == torch.float32
    assert resumed_opt.state[resumed[1].weight]["state1"].dtype == torch.uint8

    # without the 32-bit override the embedding gets 8-bit state (so the check above means something)
    plain = _bnb_model(seed=5)
    plain_opt = optim.build_optimizer(plain, 3e-3, 0.01, 0.9, 0.95, 1e-8, use_bnb_optimizer=True)
    _bnb_train(plain, plain_opt, 1, torch.Generator().manual_seed(9))
    assert plain_opt.state[plain[0].weight]["state1"].dtype == torch.uint8


# -----------------------------------------------------------------------------
# gradient utilities


def _grad_params(seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(7, 5), (5,), (3, 4, 2), (1,)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    params.append(torch.nn.Parameter(torch.zeros(3)))  # grad None: skipped
    return params


def _module(params):
    """The parameters as a model: parallel.grad_norm / count_zeros take one (with one process, the plain ops)."""
    return torch.nn.ParameterList(params)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipping, and none needed
def test_grad_norm_and_clip_match_torch(max_norm):
    ours, ref = _grad_params(), _grad_params()
    norm = parallel.grad_norm(_module(ours))
    assert norm.dtype == torch.float64 and norm.ndim == 0  # accumulated in fp64
    norm = norm.float()
    ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ref if p.grad is not None], max_norm)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    optim.clip_grads(ours, max_norm, norm)
    for p, q in zip(ours, ref):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    if max_norm > 1e5:
        assert all(
            torch.equal(p.grad, q.grad) for p, q in zip(_grad_params(), ours) if p.grad is not None
        )


def test_cpu_grad_norm_copies_pieces_to_fp64(monkeypatch):
    """On the CPU the norm's fp64 copies are of NORM_PIECE elements at most (torch's CPU norm copies a whole
    gradient to fp64 first: the vocabulary's, 155 MB at 384 x 50304, faulted in afresh every step, 38k faults),
    the norm the fp64 one of the whole gradient to 1e-12. The copies' sizes by torch.profiler's input shapes."""
    from torch.profiler import profile

    monkeypatch.setattr(parallel, "NORM_PIECE", 1000)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(50, 60), (7,), (1000,), (2, 1001)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    with profile(record_shapes=True) as prof:
        norm = parallel.grad_norm(_module(params))
    copied = [math.prod(e.input_shapes[0]) for e in prof.events() if e.name == "aten::_to_copy"]
    assert len(copied) == 3 + 1 + 1 + 3 and max(copied) == 1000, copied
    exact = math.sqrt(sum((p.grad.double() ** 2).sum().item() for p in params))
    assert math.isclose(norm.item(), exact, rel_tol=1e-12)


def test_grad_utilities_edge_cases():
    params = _grad_params()
    before = [p.grad.clone() for p in params if p.grad is not None]
    optim.clip_grads(params, 0.0, torch.tensor(100.0))  # max_norm <= 0: no clipping
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))
    optim.clip_grads(params, 1.0, 4.0)  # a float norm works too
    torch.testing.assert_close(params[0].grad, before[0] * (1.0 / (4.0 + 1e-6)))

    # fp16 gradients whose norm overflows fp16 still give the right fp32 norm
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    p.grad = torch.tensor([60000.0, 60000.0], dtype=torch.float16)
    assert parallel.grad_norm(_module([p])).item() ** 2 == pytest.approx(2 * 60000.0**2, rel=1e-6)
    assert parallel.grad_norm(_module([torch.nn.Parameter(torch.zeros(2))])).item() == 0.0


def test_count_zeros():
    params = _grad_params()
    assert parallel.count_zeros(_module(params)) == 0
    params[0].grad[2] = 0.0  # 5 zeros
    params[2].grad[0, 1, 1] = 0.0
    assert parallel.count_zeros(_module(params)) == 6
    assert parallel.count_zeros(_module(params)) == sum(
        int((p.grad == 0).sum()) for p in params if p.grad is not None
    )


# -----------------------------------------------------------------------------
# learning-rate schedule: hand computations (lesson 23)


def test_lr_sample_based_styles():
    mx, mn = 1e-3, 1e-4
    lin = AnnealingLR(mx, mn, "linear", warmup_samples=100, decay_samples=1100)
    cos = AnnealingLR(mx, mn, "cosine", warmup_samples=100, decay_samples=1100)
    const = AnnealingLR(mx, mn, "constant", warmup_samples=100)
    for s in (lin, cos, const):
        assert s.get_lr(0, 0) == 0.0
        assert s.get_lr(25, 0) == mx * 25 / 100
        assert s.get_lr(100, 0) == mx  # exactly at the end of warm-up: still the warm-up formula
    # ratio = (samples - warmup) / (decay - warmup)
    assert lin.get_lr(350, 0) == pytest.approx(mn + (1 - 0.25) * (mx - mn), rel=1e-12)
    assert cos.get_lr(350, 0) == pytest.approx(
        mn + 0.5 * (math.cos(math.pi * 0.25) + 1) * (mx - mn), rel=1e-12
    )
    assert cos.get_lr(600, 0) == pytest.approx(mn + 0.5 * (mx - mn), rel=1e-12)
    assert lin.get_lr(101, 0) == pytest.approx(mn + (1 - 1 / 1000) * (mx - mn), rel=1e-12)
    assert lin.get_lr(1099, 0) == pytest.approx(mn + (1 / 1000) * (mx - mn), rel=1e-12)
    for s in (lin, cos):
        assert s.get_lr(1100, 0) == pytest.approx(mn, abs=1e-18)  # ratio 1
        assert s.get_lr(1101, 0) == mn  # past the decay
        assert s.get_lr(10**9, 0) == mn
    assert const.get_lr(101, 0) == const.get_lr(10**9, 0) == mx
    # no warm-up
    nowarm = AnnealingLR(mx, mn, "linear", warmup_samples=0, decay_samples=1000)
    assert nowarm.get_lr(0, 0) == mx and nowarm.get_lr(500, 0) == pytest.approx(
        (mx + mn) / 2, rel=1e-12
    )


def test_lr_token_based_decay_remembers_warmup_end_tokens():
    mx, mn = 1e-3, 0.0
    s = AnnealingLR(mx, mn, "linear", warmup_samples=100, decay_samples=10**6, decay_tokens=10_000)
    assert s.get_lr(50, 1000) == mx / 2  # warm-up by samples
    assert s.warmup_end_tokens is None
    assert s.get_lr(100, 2000) == mx  # end of warm-up: 2000 tokens remembered
    assert s.warmup_end_tokens == 2000
    # ratio = (tokens - 2000) / (10000 - 2000), the samples do not matter any more
    assert s.get_lr(150, 6000) == pytest.approx(mx * 0.5, rel=1e-12)
    assert s.get_lr(999_999, 6000) == pytest.approx(mx * 0.5, rel=1e-12)
    assert s.get_lr(160, 9_999) == pytest.approx(mx * (1 - 7999 / 8000), rel=1e-12)
    assert s.get_lr(160, 10_000) == pytest.approx(0.0, abs=1e-18)
    assert s.get_lr(170, 10_001) == mn

    # remembered across save/load: a fresh scheduler without the state decays from another origin
    resumed = AnnealingLR(
        mx, mn, "linear", warmup_samples=100, decay_samples=10**6, decay_tokens=10_000
    )
    resumed.load_state_dict(_roundtrip(s.state_dict()), override=False)
    assert resumed.get_lr(150, 6000) == s.get_lr(150, 6000)
    fresh = AnnealingLR(
        mx, mn, "linear", warmup_samples=100, decay_samples=10**6, decay_tokens=10_000
    )
    assert fresh.get_lr(150, 6000) != s.get_lr(150, 6000)

    # batches that step over the warm-up end (90 -> 110 samples): recorded at the first call past it
    jump = AnnealingLR(
        mx, mn, "cosine", warmup_samples=100, decay_samples=10**6, decay_tokens=10_000
    )
    jump.get_lr(90, 1800)
    assert jump.get_lr(110, 2200) == pytest.approx(mx, rel=1e-12)  # ratio 0: no drop at warm-up end
    assert jump.warmup_end_tokens == 2200


def test_lr_token_warmup():
    s = AnnealingLR(1e-3, 1e-4, "cosine", warmup_tokens=1000, decay_tokens=11_000)
    assert s.get_lr(7, 500) == 1e-3 * 500 / 1000
    assert s.get_lr(9, 1000) == 1e-3
    assert s.get_lr(99, 6000) == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-12)
    assert s.get_lr(99, 11_001) == 1e-4


def test_lr_seed_000_numbers():
    # tr8b-104B: lr 6e-5, min 6e-6, warm-up 216_320 samples, cosine decay over 126_953_125 samples
    s = AnnealingLR(6e-5, 6e-6, "cosine", warmup_samples=216_320, decay_samples=126_953_125)
    assert f"{s.get_lr(1_519_744, 0):.3E}" == "5.999E-05"  # iteration 12000
    assert f"{s.get_lr(464_560, 0):.3E}" == "6.000E-05"  # iteration 8600 (log rounds, TB decays)
    assert f"{s.get_lr(216_960, 0):.3E}" == "6.000E-05"
    # iteration 6502 logged 5.997E-05 at 216960 consumed samples and 6503 6.000E-05 at 217040: that is
    # the schedule lagging by the samples of fp16-skipped iterations (Megatron/DeepSpeed do not step the
    # scheduler on a skipped iteration); a lag of 734 samples reproduces both lines
    assert f"{s.get_lr(216_960 - 734, 0):.3E}" == "5.997E-05"
    assert f"{s.get_lr(217_040 - 734, 0):.3E}" == "6.000E-05"

    # BNB experiment 6: resume from global_step12000 with min_lr 6e-7, decay 12_695_312, override
    new = AnnealingLR(6e-5, 6e-7, "cosine", warmup_samples=216_320, decay_samples=12_695_312)
    with pytest.raises(ValueError, match="minimum learning rate"):
        new.load_state_dict(s.state_dict(), override=False)
    new.load_state_dict(s.state_dict(), override=True)
    # the log line of iteration 12001 shows 5.842E-05: the lr that iteration ran with, i.e. the new
    # schedule at the 1_519_744 samples consumed before it; after its 528 samples it is 5.841E-05
    assert f"{new.get_lr(1_519_744, 0):.3E}" == "5.842E-05"
    assert f"{new.get_lr(1_520_272, 0):.3E}" == "5.841E-05"
    ratio = (1_520_272 - 216_320) / (12_695_312 - 216_320)
    assert new.get_lr(1_520_272, 0) == pytest.approx(
        6e-7 + 0.5 * (math.cos(math.pi * ratio) + 1) * (6e-5 - 6e-7), rel=1e-12
    )


def test_lr_load_state_dict_mismatch_message_and_override():
    ckpt = AnnealingLR(6e-5, 1e-5, "cosine", warmup_samples=1000, decay_samples=100_000)
    cfg = AnnealingLR(6e-5, 1e-6, "cosine", warmup_samples=1000, decay_samples=100_000)
    with pytest.raises(ValueError) as err:
        cfg.load_state_dict(ckpt.state_dict(), override=False)
    assert str(err.value) == (
        "AnnealingLR: class input value 1e-06 and checkpoint value 1e-05 for minimum learning rate do not "
        "match; to use the config's schedule from the current consumed samples/tokens, set "
        "override_lr_scheduler (--override-lr-scheduler)"
    )
    # each checked quantity is named
    for kwargs, name in [
        (dict(max_lr=1e-4), "learning rate"),
        (dict(warmup_samples=10), "warm-up samples"),
        (dict(decay_samples=5000), "decay samples"),
        (dict(decay_style="linear"), "decay style"),
        (dict(decay_tokens=10**9), "decay tokens"),
    ]:
        args = dict(
            max_lr=6e-5,
            min_lr=1e-5,
            decay_style="cosine",
            warmup_samples=1000,
            decay_samples=100_000,
        )
        args.update(kwargs)
        with pytest.raises(ValueError, match=f"for {name} do not match"):
            AnnealingLR(**args).load_state_dict(ckpt.state_dict(), override=False)

    # override: the config's values win
    cfg.load_state_dict(ckpt.state_dict(), override=True)
    assert cfg.min_lr == 1e-6
    assert cfg.get_lr(100_000, 0) == pytest.approx(1e-6, abs=1e-18)
    assert ckpt.get_lr(100_000, 0) == pytest.approx(1e-5, abs=1e-18)
    # same config: loads silently
    AnnealingLR(6e-5, 1e-5, "cosine", warmup_samples=1000, decay_samples=100_000).load_state_dict(
        ckpt.state_dict(), override=False
    )


def test_lr_override_with_changed_warmup():
    kw = dict(decay_samples=10**6, decay_tokens=100_000)
    ckpt = AnnealingLR(1e-3, 0.0, "linear", warmup_samples=100, **kw)
    ckpt.get_lr(100, 2000)  # warm-up ended at 2000 tokens
    sd = ckpt.state_dict()

    # unchanged warm-up (lesson 8's optimizer reset: lr 0 / min_lr 0 with override): restored
    reset = AnnealingLR(0.0, 0.0, "linear", warmup_samples=100, **kw)
    reset.load_state_dict(sd, override=True)
    assert reset.warmup_end_tokens == 2000 and reset.get_lr(300, 6000) == 0.0

    # longer warm-up not reached yet: recorded again when it ends
    longer = AnnealingLR(1e-3, 0.0, "linear", warmup_samples=400, **kw)
    longer.load_state_dict(sd, override=True)
    assert longer.get_lr(300, 6000) == pytest.approx(1e-3 * 300 / 400)
    assert longer.get_lr(400, 8000) == 1e-3
    assert longer.warmup_end_tokens == 8000

    # shorter warm-up already in the past: its token count was never seen; the checkpoint's is kept
    shorter = AnnealingLR(1e-3, 0.0, "linear", warmup_samples=50, **kw)
    shorter.load_state_dict(sd, override=True)
    assert shorter.get_lr(300, 6000) == pytest.approx(1e-3 * (1 - 4000 / 98_000), rel=1e-12)


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (
            dict(max_lr=1e-4, min_lr=1e-3, decay_style="cosine", decay_samples=10),
            "min_lr 0.001 is larger than lr",
        ),
        (
            dict(max_lr=1e-3, min_lr=0, decay_style="cosine", warmup_samples=10, decay_samples=10),
            "must be larger",
        ),
        (
            dict(max_lr=1e-3, min_lr=0, decay_style="exponential", decay_samples=10),
            "unknown lr_decay_style",
        ),
        (dict(max_lr=1e-3, min_lr=0, decay_style="cosine"), "needs lr_decay_samples"),
        (
            dict(max_lr=1e-3, min_lr=0, decay_style="cosine", warmup_tokens=10, decay_samples=100),
            "needs lr_decay_tokens",
        ),
        (
            dict(
                max_lr=1e-3,
                min_lr=0,
                decay_style="cosine",
                warmup_samples=5,
                warmup_tokens=10,
                decay_tokens=100,
            ),
            "set only one",
        ),
        (
            dict(max_lr=1e-3, min_lr=0, decay_style="cosine", warmup_tokens=100, decay_tokens=100),
            "lr_decay_tokens",
        ),
    ],
)
def test_lr_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        AnnealingLR(**kwargs)


def test_lr_describe():
    s = AnnealingLR(6e-5, 6e-6, "cosine", warmup_samples=216_320, decay_samples=126_953_125)
    assert s.describe() == (
        "lr schedule: max_lr 6e-05, min_lr 6e-06, warm-up 216320 samples, "
        "cosine decay to 126953125 samples"
    )


# -----------------------------------------------------------------------------
# fp16 loss scaling


def test_loss_scaler_reproduces_seed_000_overflow_sequence():
    # tr8b-104B emb-norm experiment 7, iterations 17060-17068 (prefixes "[deepscale]" / "Rank 0" left out)
    scaler = LossScaler(initial_scale=1048576.0, hysteresis=2)
    events = [False, False, True, True, True, True, False, True, True]
    expected = [
        None,
        None,
        "OVERFLOW! Skipping step. Attempted loss scale: 1048576.0, reducing to 1048576.0",
        "OVERFLOW! Skipping step. Attempted loss scale: 1048576.0, reducing to 524288.0",
        "OVERFLOW! Skipping step. Attempted loss scale: 524288.0, reducing to 262144.0",
        "OVERFLOW! Skipping step. Attempted loss scale: 262144.0, reducing to 131072.0",
        None,
        "OVERFLOW! Skipping step. Attempted loss scale: 131072.0, reducing to 65536.0",
        "OVERFLOW! Skipping step. Attempted loss scale: 65536.0, reducing to 32768.0",
    ]
    logged_scales = [
        1048576.0,
        1048576.0,
        1048576.0,
        524288.0,
        262144.0,
        131072.0,
        131072.0,
        65536.0,
        32768.0,
    ]
    for overflow, line, logged in zip(events, expected, logged_scales):
        assert scaler.update(overflow) == line
        assert scaler.scale == logged


def test_loss_scaler_growth_hysteresis_and_floor():
    s = LossScaler(initial_scale=2.0**10, min_scale=256.0, window=4, hysteresis=2)
    for _ in range(3):
        assert s.update(False) is None
    assert s.scale == 2.0**10
    s.update(False)  # 4th clean step in a row
    assert s.scale == 2.0**11
    # an overflow restarts the clean-step count
    for _ in range(3):
        s.update(False)
    s.update(True)  # hysteresis 2 -> 1, scale kept
    assert s.scale == 2.0**11
    for _ in range(3):
        s.update(False)
    assert s.scale == 2.0**11
    s.update(False)  # 4 clean steps since the overflow: grow and restore the hysteresis
    assert s.scale == 2.0**12
    s.update(True)
    assert s.scale == 2.0**12  # hysteresis absorbed this one again
    for expected in [2.0**11, 2.0**10, 2.0**9, 2.0**8, 2.0**8, 2.0**8]:
        s.update(True)
        assert s.scale == expected  # halves, floored at min_scale
    assert (
        s.update(True) == "OVERFLOW! Skipping step. Attempted loss scale: 256.0, reducing to 256.0"
    )

    first = LossScaler()  # defaults: 2^32, hysteresis 2 -> the second overflow halves
    first.update(True)
    first.update(True)
    assert first.scale == 2.0**31


def test_loss_scaler_static_and_none():
    static = LossScaler(static_scale=4096.0, window=1)
    none = LossScaler(dynamic=False, static_scale=1.0)
    fixed = LossScaler(dynamic=False, initial_scale=512.0)
    for s, value in [(static, 4096.0), (none, 1.0), (fixed, 512.0)]:
        for overflow in [False, False, True, True, True, False]:
            line = s.update(overflow)
            assert (line is not None) == overflow
            assert s.scale == value
        s.load_state_dict({"scale": 2.0, "clean_steps": 0, "hysteresis_left": 1})
        assert s.scale == value


def test_loss_scaler_state_round_trip():
    a = LossScaler(initial_scale=2.0**16, window=5, hysteresis=3)
    for overflow in [True, True, True, False, False, True, False]:
        a.update(overflow)
    assert (a.scale, a.clean_steps, a.hysteresis_left) == (2.0**14, 1, 0)
    b = LossScaler(initial_scale=2.0**16, window=5, hysteresis=3)
    b.load_state_dict(_roundtrip(a.state_dict()))
    # not restored: must behave differently
    c = LossScaler(initial_scale=2.0**16, window=5, hysteresis=3)
    events = [False, False, False, False, True, True, True]
    for overflow in events:
        assert a.update(overflow) == b.update(overflow)
        assert a.state_dict() == b.state_dict()
        c.update(overflow)
    assert c.scale != a.scale


def test_bnb_keeps_an_untied_output_layers_state_32bit_as_the_embeddings():
    """The untied output layer is the other vocabulary-sized table: 8-bit state there is what StableEmbedding's
    32-bit override exists to avoid for the embedding (lesson 14). fp32 and bf16 (state on the fp32 masters)."""
    pytest.importorskip("bitsandbytes")
    import arguments
    from builders import build_model, build_optimizer, step_rules
    from training import whole_step

    for precision in ([], ["--bf16"]):
        cfg = arguments.prepare(
            arguments.load_config(
                [
                    "--num_layers=1",
                    "--hidden_size=64",
                    "--num_attention_heads=2",
                    "--seq_length=16",
                    "--vocab_size=512",
                    "--micro_batch_size=2",
                    "--global_batch_size=2",
                    "--use_bnb_optimizer",
                    "--untie_embeddings_and_output_weights",
                    *precision,
                ]
            )
        )
        model = build_model(cfg, torch.device("cpu"))
        opt = build_optimizer(cfg, model)
        x = torch.randint(0, 512, (2, 16))
        assert (
            whole_step(
                model,
                opt,
                optim.scaler_for(cfg),
                [(x, x)],
                1e-3,
                step_rules(cfg),
                torch.device("cpu"),
            ).outcome
            == "ok"
        )
        # the tensor the optimizer keeps state for
        main = dict(zip(map(id, opt.model_params), opt.main_params))
        dtypes = {
            name: opt.optimizer.state[main[id(p)]]["state1"].dtype
            for name, p in model.named_parameters()
        }
        assert dtypes["output_layer"] == dtypes["embed.word.weight"] == torch.float32, dtypes
        # the others 8-bit: the check means something
        assert dtypes["blocks.0.mlp.fc1.weight"] == torch.uint8, dtypes


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--adam_beta2=1.0"], r"^adam_beta2=1.0 must be in \[0, 1\) \(0.95 for large runs\)$"),
        (["--adam_beta1=-0.1"], r"^adam_beta1=-0.1 must be in \[0, 1\)"),
        (["--adam_eps=-1e-8"], r"^adam_eps=-1e-08 must not be negative"),
        (["--fp16", "--loss_scale=0"], r"^loss_scale=0.0 must be positive"),
        (["--fp16", "--initial_loss_scale=0"], r"^initial_loss_scale=0.0 must be positive"),
        (
            ["--fp16", "--initial_loss_scale=1024", "--min_loss_scale=2048"],
            r"^min_loss_scale=2048.0 must be positive and at most initial_loss_scale=1024",
        ),
        (["--fp16", "--loss_scale_window=0"], r"^loss_scale_window=0 must be at least 1"),
        (["--fp16", "--hysteresis=0"], r"^hysteresis=0 must be at least 1"),
        # a static scale never changes: the dynamic scaler's keys beside it were ignored in silence
        (
            ["--fp16", "--loss_scale=1024", "--initial_loss_scale=4096", "--hysteresis=1"],
            r"^loss_scale=1024.0 is a static loss scale, which never changes: initial_loss_scale=4096.0, "
            r"hysteresis=1 \(the dynamic scale's\) would be ignored; drop loss_scale for the dynamic "
            r"scale, or drop them$",
        ),
    ],
)
def test_adam_and_loss_scale_keys_are_refused_by_name_before_anything_is_built(flags, message):
    """AdamW's constructor and LossScaler refused these only once the model was built, in their own words
    (betas, 'loss scale'); optim.check names the key, in arguments.validate."""
    import arguments

    cfg = arguments.load_config(["--train_iters=1", *flags])
    with pytest.raises(ValueError, match=message):
        arguments.validate(cfg, reads_data=False)


def test_a_static_loss_scale_on_the_command_line_replaces_the_files_dynamic_keys(tmp_path, capsys):
    """The fp16 configs carry DeepSpeed's dynamic scaler (initial_loss_scale=4096, loss_scale_window=500);
    --loss_scale on the command line is the user's choice of a static scale: the file's dynamic keys are left
    out, said in one line each, and the run is the static one asked for."""
    import arguments

    config = tmp_path / "fp16.py"
    config.write_text(
        "fp16 = True\ninitial_loss_scale = 4096\nloss_scale_window = 500\ntrain_iters = 1\n"
    )
    cfg = arguments.load_config([str(config), "--loss_scale=12"])
    arguments.validate(cfg, reads_data=False)
    assert (cfg.loss_scale, cfg.initial_loss_scale, cfg.loss_scale_window) == (12.0, 2.0**32, 1000)
    assert optim.scaler_for(cfg).state_dict()["scale"] == 12.0
    out = capsys.readouterr().out
    assert (
        "loss_scale from the command line replaces the config file's initial_loss_scale = 4096"
        in out
    )
