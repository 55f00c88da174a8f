"""The field's remedies (stability/remedies.py), each against its published rule re-implemented here from the
source it cites, step by step on a scripted loss / grad-norm series (its decision at every step, and again across a
checkpoint of its state); then in short train.py runs of the tests' 2x64 model: each acts on a planted fault (an LR
3000x too high for two iterations) and none acts on a clean run, whose losses equal a faulted run's before the
fault; Megatron's re-run reproduces the loss with dropout on (from the step's RNG state). OPT/metaseq's skip (the
core's skip_grad_norm_above) is checked in the same runs."""

import math
import random
import re

import pytest
import torch

import arguments
import training
from helpers import (  # noqa: F401 (corpus, corpus512: fixtures)
    corpus,
    corpus512,
    guard_model_args,
    log_fields,
    losses,
    run_main,
)
from stability import config as stability_config
from stability import remedies


def series(n=220, seed=0):
    """A falling, noisy loss and grad norm, with spikes planted: a loss spike inside a 128-window's warm-up (30), a
    loss spike (90), a grad-norm spike (130), a loss and grad norm spike together (170), a NaN-free tail."""
    rng = random.Random(seed)
    loss = [5.0 - 0.004 * i + rng.gauss(0, 0.05) for i in range(n)]
    norm = [1.0 + rng.gauss(0, 0.1) for _ in range(n)]
    loss[30] += 3.0
    loss[90] += 6.0
    norm[130] *= 5
    loss[170], norm[170] = loss[170] + 1.0, norm[170] * 3
    return loss, norm


def cfg_with(**keys):
    cfg = arguments.Config()
    for key, value in keys.items():
        setattr(cfg, key, value)
    return cfg


# -----------------------------------------------------------------------------
# OLMo-core's SkipStep


def olmo_skip_step(losses_, norms, window=128, sigma=6):
    """SkipStepOptimizer as OLMo-core writes it: values appended every step (skipped or not), kept to window + 1,
    no decision before max(2, window // 2) of them, then torch.std_mean over all but the last."""
    kept_l, kept_g, skipped = [], [], []
    for loss, norm in zip(losses_, norms):
        kept_l, kept_g = (
            (kept_l + [torch.tensor(loss, dtype=torch.float64)])[-(window + 1) :],
            (kept_g + [torch.tensor(norm, dtype=torch.float64)])[-(window + 1) :],
        )
        if len(kept_l) < max(2, window // 2):
            skipped.append(False)
            continue
        l_std, l_mean = torch.std_mean(torch.stack(kept_l[:-1]))
        g_std, g_mean = torch.std_mean(torch.stack(kept_g[:-1]))
        step = bool(
            torch.logical_and(
                kept_l[-1] - l_mean <= sigma * l_std, kept_g[-1] - g_mean <= sigma * g_std
            )
        )
        skipped.append(not step)
    return skipped


def drive(callback, losses_, norms, start=0):
    factors = []
    for i, (loss, norm) in enumerate(zip(losses_, norms), start + 1):
        callback.before_step(training.Iteration(number=i, first_sample=0, batch_size=8, seqlen=64))
        factors.append(callback.update_factor(loss, norm))
    return factors


@pytest.mark.parametrize("window", [128, 20])
def test_skip_step_decides_as_olmo_core_at_every_step_and_across_a_checkpoint(window):
    loss, norm = series()
    # a grad norm under the bar with the sample standard deviation (torch.std's), over it with the population's
    before = torch.tensor(norm[200 - window : 200], dtype=torch.float64)
    norm[200] = float(before.mean() + 6 * before.std() * (1 + math.sqrt((window - 1) / window)) / 2)
    want = olmo_skip_step(loss, norm, window=window)
    cfg = cfg_with(skip_step_sigma=6.0, skip_step_window=window)
    got = [f == 0.0 for f in drive(remedies.SkipStep(cfg), loss, norm)]
    assert got == want
    # the planted spikes are skipped ...
    assert want[90] and want[130] and want[170] and not want[200]
    # ... the one in a 128-window's warm-up is not
    assert not want[30] if window == 128 else want[30]
    first = remedies.SkipStep(cfg)
    drive(first, loss[:150], norm[:150])
    resumed = remedies.SkipStep(cfg)
    resumed.load_state_dict(first.state_dict(), None, resume=True)
    assert [f == 0.0 for f in drive(resumed, loss[150:], norm[150:], start=150)] == want[150:]


# -----------------------------------------------------------------------------
# Megatron-LM's spiky-loss check


def megatron_spiky(losses_, threshold=10, num_samples=100):
    """is_unexpectedly_large as Megatron-LM writes it, called for every iteration but the job's first (no
    validation before a first optimizer step): the first num_samples values set the max, never flagged."""
    flagged, count, largest = [False], 0, 0.0
    for loss in losses_[1:]:
        value = math.fabs(loss)
        if count < num_samples:
            count, largest = count + 1, max(largest, value)
            flagged.append(False)
        else:
            flagged.append(value >= largest * threshold)
    return flagged


def test_spiky_loss_flags_as_megatron_at_every_step_and_across_a_checkpoint(capsys, monkeypatch):
    loss, norm = [5.0 + 0.1 * math.sin(i) for i in range(220)], series()[1]
    # 8.0 among the first 100 sets the bar at 80 for good: 55 is no spike, 85 is, and 80 itself is (>=)
    loss[5], loss[150], loss[200], loss[210] = 8.0, 55.0, 85.0, 80.0
    want = megatron_spiky(loss, num_samples=100)
    cfg = cfg_with(spiky_loss_factor=10.0, spiky_loss_samples=100)
    callback = remedies.SpikyLoss(cfg, None)
    # a re-run differing from every loss here
    monkeypatch.setattr(callback, "rerun", lambda: callback.it.number)
    factors = drive(callback, loss, norm)
    flagged = [
        int(line.split("iteration ")[1].split(":")[0])
        for line in capsys.readouterr().out.splitlines()
    ]
    assert flagged == [i + 1 for i, f in enumerate(want) if f] == [201, 211]
    assert factors == [1.0] * len(loss)  # it never vetoes: Megatron goes on (fatal=False)
    again = remedies.SpikyLoss(cfg, None)
    again.load_state_dict(callback.state_dict(), None, resume=True)
    assert again.state == {"count": 100, "max": 8.0}


# -----------------------------------------------------------------------------
# ZClip


class ReferenceZClip:
    """ZClip's step() (github.com/bluorion-com/ZClip, zclip/zclip.py) with its defaults (zscore, adaptive_scaling,
    clip_factor 1) and max_grad_norm None, on a given total norm: the coefficient it scales the gradients by."""

    def __init__(self, alpha=0.97, z_thresh=2.5, warmup_steps=25, eps=1e-6):
        self.alpha, self.z_thresh, self.warmup, self.eps = alpha, z_thresh, warmup_steps, eps
        self.buffer, self.mean, self.var = [], None, None

    def step(self, total_norm):
        if self.mean is None:
            self.buffer.append(total_norm)
            if len(self.buffer) >= self.warmup:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
            return 1.0
        std = self.var**0.5
        z = (total_norm - self.mean) / (std + self.eps)
        clip = (
            self.mean + (self.z_thresh * std) / (z / self.z_thresh) if z > self.z_thresh else None
        )
        effective = clip if clip is not None else total_norm
        coef = effective / (total_norm + 1e-6) if total_norm > effective else 1.0
        self.mean = self.alpha * self.mean + (1 - self.alpha) * effective
        self.var = self.alpha * self.var + (1 - self.alpha) * (effective - self.mean) ** 2
        return coef


def test_zclip_scales_as_the_zclip_repository_at_every_step_and_across_a_checkpoint(capsys):
    loss, norm = series()
    reference = ReferenceZClip()
    want = [reference.step(g) for g in norm]
    cfg = cfg_with(zclip_z=2.5, zclip_alpha=0.97, zclip_warmup=25)
    got = drive(remedies.ZClip(cfg), loss, norm)
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert want[130] < 0.3 and want[170] < 0.5 and all(w == 1.0 for w in want[:25])
    first = remedies.ZClip(cfg)
    drive(first, loss[:150], norm[:150])
    resumed = remedies.ZClip(cfg)
    resumed.load_state_dict(first.state_dict(), None, resume=True)
    assert drive(resumed, loss[150:], norm[150:], start=150) == pytest.approx(
        want[150:], rel=1e-12, abs=0
    )


def test_bad_remedy_keys_name_the_fix():
    for keys, words in (
        ({"skip_step_sigma": 6.0, "skip_step_window": 5}, "skip_step_window >= 6"),
        ({"spiky_loss_factor": 0.5}, "spiky_loss_factor=0.5 must be 0 (off) or > 1"),
        ({"zclip_z": 2.5, "zclip_alpha": 1.0}, "zclip_alpha in (0, 1)"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            stability_config.check(cfg_with(**keys))


# -----------------------------------------------------------------------------
# In train.py: each acts on a planted fault, none on a clean run

# the loss ~3,000 from iteration 26 on
FAULT = ["--inject_lr_iters=25-26", "--inject_lr_factor=3000"]
# neither vetoes nor skips
WATCH = ["--spiky_loss_factor=10", "--spiky_loss_samples=10", "--zclip_z=2.5"]


@pytest.fixture(scope="module")
def run(corpus512):
    base = guard_model_args(corpus512, iters=30)
    return lambda *extra: run_main(*base, *extra)


def acted(out, name):
    return [
        int(x.split("iteration ")[1].split(":")[0])
        for x in out.splitlines()
        if x.startswith(f"remedy {name}:")
    ]


def skipped(out):
    return [
        i
        for i, f in log_fields(out).items()
        if f.get("number of skipped iterations", "0").strip() != "0"
    ]


@pytest.mark.slow
def test_each_remedy_acts_on_a_planted_lr_fault_and_none_on_a_clean_run(run):
    clean = run(*WATCH, "--skip_step_sigma=6", "--skip_step_window=20", "--skip_grad_norm_above=10")
    assert not [x for x in clean.splitlines() if x.startswith("remedy ")] and not skipped(clean)
    watched = run(*FAULT, *WATCH)
    assert {i: v for i, v in losses(watched).items() if i <= 25} == {
        i: v for i, v in losses(clean).items() if i <= 25
    }
    assert acted(watched, "spiky_loss")[0] == 26 and "reproducible (Megatron" in watched
    assert acted(watched, "zclip")[0] == 26
    # dropout on: the re-run reproduces the loss only from the step's own RNG state
    dropout = run(
        *FAULT, "--spiky_loss_factor=10", "--spiky_loss_samples=10", "--hidden_dropout=0.1"
    )
    assert acted(dropout, "spiky_loss")[0] == 26 and "not reproducible" not in dropout
    skip_step = run(*FAULT, "--skip_step_sigma=6", "--skip_step_window=20")
    assert acted(skip_step, "skip_step")[0] == 26 and 26 in skipped(skip_step)
    metaseq = run(*FAULT, "--skip_grad_norm_above=10")  # OPT's rule: the bound on the grad norm
    assert skipped(metaseq)[0] == 26
