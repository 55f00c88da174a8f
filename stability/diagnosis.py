"""The spike guard's diagnosis: why did this step spike? (docs/spike_guard.md, section 2; lesson 21; PaLM,
Megatron-LM's rerun state machine)

    step, diagnosis = investigate(guard, parts, step, iteration, before, snapshots, rerun, forward, other, per_sample)

Before the guard acts on a suspect step (SUSPECT), it is replayed -- same weights, batch, RNG and loss scaler --
and its weights and batch are tested, the cause named: hardware (not reproduced, or weights the optimizer cannot
have written), persistent (the same DP rank disagrees again), numerical (ordinary in fp32), data (the batch is the
outlier) or optimizer (the weights are). What the cause calls for is spike_guard.py's. The samples behind a spike
are named here too (name_samples), and a data spike's documents appended to the skip list.

Every rank runs the same replays on the same numbers (the step's are DP rank 0's on every replica: training.agree).
"""

import math
import os

import torch
import torch.distributed as dist

import checkpoint
import loader
import optim
import parallel
import training
from report import print0
from stability import skip_list
from stability.detector import Series, snapshot_stats

SUSPECT = ("vetoed", "nan", "replicas differ")  # train_step's outcomes investigate() looks into ...


def overflowed(step):
    """... and a step skipped for a non-finite grad norm (an fp16 overflow, a NaN gradient)."""
    return step.outcome == "skipped" and not math.isfinite(step.grad_norm)


def suspect(step, scaler):
    """Is this step one investigate() looks into before the guard acts: a SUSPECT outcome, or a
    non-finite grad norm that no loss scaler answers -- fp32 or bf16 (a NaN gradient is never
    ordinary there), or fp16's dynamic loss scale at its floor (while it can still halve, an
    overflow is the scaler's business, the search from initial_loss_scale included)."""
    if step.outcome in SUSPECT:
        return True
    searching = scaler is not None and scaler.dynamic and scaler.scale > scaler.min_scale
    return overflowed(step) and not searching


class Veto(training.Callback):
    """The callbacks of a replay (and of the counterfactual step): judge(loss, grad norm) -- a reason, or None --
    vetoes its update, and nothing else acts (no fault, no probe, no soft skip)."""

    def __init__(self, judge=None):
        self.judge = judge

    def update_factor(self, loss, grad_norm):
        return 0.0 if self.judge is not None and self.judge(loss, grad_norm) else 1.0


def measure_noise(model, batches, core, device):
    """The run's own nondeterminism, once, when the guard arms: the relative difference of the batch's loss
    and the loss of the same forward again, same RNG (0 on CPU; GPU kernels that use atomics
    differ). core: the core's keys its forward reads (stability.CoreKeys), here and below."""
    rng = checkpoint.rng_state()
    first = evaluate_batches(model, batches, core, device)
    checkpoint.set_rng_state(rng)
    again = evaluate_batches(model, batches, core, device)
    checkpoint.set_rng_state(rng)
    return abs(first - again) / max(abs(first), 1e-30)


def investigate(
    guard,
    parts,
    step,
    iteration,
    before,
    snapshots,
    rerun,
    forward,
    other=None,
    per_sample=None,
    fp32_replay=False,
):
    """Before the guard acts on a suspect step: (step, diagnosis). The weights and optimizer are
    still those before the step (a suspect step is never applied); before = (RNG state, loss scaler
    state) before it.
    1. replay: the step again, same weights, batch, RNG and loss scaler (rerun(judge, scaler) runs
       train_step on the run's parts, with its scaler unless another is given). Not reproduced
       -- the replay is no spike, or the DP replicas disagreed -- is a transient fault ("hardware"):
       the replay applied its update (the step retried) and its step is returned.
    2. reproduced: are the weights ones the optimizer can have written (_corruption_verdict)?
    3. fp16/bf16 (fp32_replay: spike_guard_fp32_replay in half precision): the step replayed in fp32
       (same batch, RNG and master weights). Ordinary there: "numerical", and the fp32 step was
       applied and is returned.
    4. the batch on the model of the newest snapshot two updates or more back (forward() is the loss
       of the batch on the live model): "data" or "optimizer" (_batch_verdict), other() a batch
       these weights were never trained on (held out: guard.comparison), per_sample() the batch's
       per-sample losses.
    "Reproduced" means a spike again whose loss is within the run's own nondeterminism of the first
    (guard.noise, measured when the guard arms, as Megatron's rerun state machine measures what it
    tolerates); a replay on which the same DP rank disagrees again is a persistent fault of that
    rank, not a transient one.
    Costs one extra step (two in half precision: one of them in fp32), one more step (not applied)
    for the counterfactual and three forwards per spike; a clean run never calls it."""
    rows = list(step.replicas)
    rng_before, scaler_before = before
    checkpoint.set_rng_state(rng_before)
    parts.scaler.load_state_dict(scaler_before)  # the step's fp16 overflow counted once, not twice
    replay = rerun(guard.judge if guard.armed() else None)
    found = replay_verdict(guard, step, replay, rows, list(replay.replicas))
    if found is not None:
        return replay, found
    replayed = f"replayed: {said(replay)}, reproduced"
    snapshot = snapshots.newest_before(iteration - 1)
    found = _corruption_verdict(guard, parts, iteration, snapshot, replayed)
    if found is not None:
        return replay, found
    if fp32_replay:
        exact, replayed, found = _fp32_verdict(guard, step, rng_before, parts, rerun, replayed)
        if found is not None:
            return exact, found
    return replay, _batch_verdict(
        guard, parts.model, replay, replayed, snapshot, snapshots, forward, other, per_sample
    )


def _corruption_verdict(guard, parts, iteration, snapshot, replayed):
    """A reproduced spike's weights against the snapshot before it (None: none): "hardware" or None.

    A weight that moved farther since the snapshot than the optimizer can move it at the LRs
    applied since was written by something else: a silent corruption ("hardware", rolled back: the
    replay reproduces it because it is in the state)."""
    if snapshot is None:
        return None
    corrupted = corrupted_weights(guard, parts.model, parts.optimizer, iteration, *snapshot)
    if corrupted is None:
        return None
    rank, evidence = corrupted
    return {
        "cause": "hardware",
        "evidence": f"{replayed}; {evidence}",
        "rank": rank,
        "rollback": True,
    }


def _fp32_verdict(guard, step, rng_before, parts, rerun, replayed):
    """(the fp32 replay, the evidence so far, "numerical" if the replay is ordinary else None)."""
    exact = replay_in_fp32(guard, rng_before, parts.model, parts.optimizer, rerun)
    in_fp32 = f"{replayed}; in fp32: loss {exact.loss:.6g}, grad norm {exact.grad_norm:.6g}"
    if exact.outcome == "ok":  # overflow: the core skips such a step (SpikeGuard._numerical)
        numerical = {
            "cause": "numerical",
            "evidence": f"{in_fp32}, ordinary",
            "overflow": overflowed(step),
        }
        return exact, replayed, numerical
    return exact, f"{in_fp32}, a spike too", None


def _batch_verdict(guard, model, replay, replayed, snapshot, snapshots, forward, other, per_sample):
    """A reproduced spike of sound weights: "data" or "optimizer", from the batch on older weights.

    Still an outlier on the snapshot's model against its own trend: "data". The batch is ordinary
    there, the loss is not now: the update went wrong ("optimizer"). The verdict between the two is
    a counterfactual, asked on both signs of the loss (data_or_optimizer): other() is a batch these
    weights were never trained on, computed and never applied, and the same batch on the snapshot's
    weights. Ordinary here: the weights are fine and this batch is the cause ("data", however low
    its loss: a batch of one repeated token has a loss far below its trend and a grad norm far above
    it). A spike here too, and worse than on the snapshot's weights: the updates since did it
    ("optimizer"; the rollback changes the trajectory, SpikeGuard._rollback); as far off there: the
    trend is stale (data, re-based). Of the batch's per-sample losses (per_sample()), a minority far
    from the others' median is named (diagnosis "suspects"), with the batch's loss without them."""
    if snapshot is None:
        return without_snapshot(guard, replay, replayed, other)
    return data_or_optimizer(
        guard,
        model,
        replay,
        replayed,
        snapshot,
        forward,
        other,
        per_sample,
        snapshots.oldest(disk=False),
    )


def ask_unseen(other):
    """(the RNG state after the step, other()'s unseen batch on these weights or None: none asked, or past
    the end of the data), the RNG put back as it was: the counterfactual draws nothing from the run."""
    rng_after = checkpoint.rng_state()
    unseen = other() if other is not None else None
    checkpoint.set_rng_state(rng_after)
    return rng_after, unseen


def without_snapshot(guard, replay, replayed, other):
    """A reproduced spike before the first snapshot (none two updates back): the batch against an unseen
    one on these weights alone (unseen_verdict, no older weights). The unseen batch ordinary, or this
    batch far below it: "data". Off its trend too: not this batch's -- the weights moved and the trend
    lags them (a high LR's first updates raise every batch's loss), and with nothing older to roll back
    to no remedy beats the step itself: "optimizer", "unrepairable" (SpikeGuard._unrepairable: the
    update applied as without the guard, the trend re-based to the unseen batch's numbers). Called data,
    such a spike had its update skipped on weights that then could not change, so the next batch spiked
    too: 34 updates in a row until the first snapshot, where the unguarded run was learning again the
    next iteration (docs/lessons.md, lesson 21: never worse than doing nothing)."""
    rng_after, unseen = ask_unseen(other)
    if unseen is None:  # the end of the data: nothing to ask
        return {"cause": "data", "evidence": f"{replayed}; no earlier snapshot, no unseen batch"}
    expected = guard.series["loss"].expected()
    excess_now = replay.loss - expected if math.isfinite(replay.loss) else math.inf
    step, label, _ = unseen
    data, decided, words, rebase = unseen_verdict(
        guard, None, None, None, excess_now, rng_after, step, label, None
    )
    diagnosis = {"cause": "data" if data else "optimizer", "decided_by": decided}
    if not data:  # rebase: the unseen batch's finite numbers, else None
        diagnosis["unrepairable"], diagnosis["trend"] = True, rebase
    diagnosis["evidence"] = (
        f"{replayed}; no earlier snapshot{words}; decided by {decided}: the "
        + (
            "batch is the outlier"
            if data
            else "batch is ordinary, the weights are not, and there is nothing to roll back to"
        )
    )
    return diagnosis


def said(step):
    return f"loss {step.loss:.6g}, grad norm {step.grad_norm:.6g}"


def differing(rows):
    """The DP ranks whose numbers differ from DP rank 0's."""
    return [r for r, row in enumerate(rows) if repr(row) != repr(rows[0])]


def replay_verdict(guard, step, replay, rows, rows_again):
    """What the replay alone says, or None when it reproduced the spike: the same DP rank disagreeing again is a
    persistent fault; a spike beyond the run's nondeterminism from the first, or no spike, or replicas that
    disagreed, a transient one ("hardware")."""
    first, again = said(step), said(replay)
    differ, differ_again = differing(rows), differing(rows_again)
    if differ and differ_again[:1] == differ[:1]:
        rank = differ[0]
        return {
            "cause": "persistent",
            "rank": rank,
            "evidence": f"DP rank {rank} computed loss {rows[rank][0]:.6g}, "
            f"DP rank 0 {first}; replayed, DP rank {rank} again: loss {rows_again[rank][0]:.6g}, DP rank 0 {again}",
        }
    tolerance = reproduced_tolerance(guard.noise)
    close = (not math.isfinite(step.loss) and not math.isfinite(replay.loss)) or abs(
        replay.loss - step.loss
    ) <= tolerance * abs(step.loss)
    spiked = replay.outcome in SUSPECT or overflowed(replay)  # an overflow replayed is reproduced
    if spiked and not close and not differ:
        rank = 0 if parallel.grid.dp_size == 1 else None
        return {
            "cause": "hardware",
            "rank": rank,
            "evidence": f"first {first}; replayed: {again}, a spike that "
            f"differs by more than the run's nondeterminism allows ({tolerance:.2g} relative)",
        }
    if differ or not spiked:
        rank = differ[0] if differ else (0 if parallel.grid.dp_size == 1 else None)
        if differ:
            evidence = (
                f"DP rank {rank} computed loss {rows[rank][0]:.6g}, grad norm {rows[rank][1]:.6g}, DP rank 0 "
                f"{first}; replayed: {again}"
            )
        else:
            evidence = f"first {first}; replayed: {again}, not reproduced"
        return {"cause": "hardware", "evidence": evidence, "rank": rank}
    return None


def data_or_optimizer(
    guard, model, replay, replayed, snapshot, forward, other, per_sample, oldest=None
):
    """A reproduced spike of sound weights: is the batch the outlier ("data") or the weights ("optimizer")? The
    fair question is asked of a batch these weights were never trained on (other(): held out; the
    last applied batch looks ordinary on weights just trained on it, whatever the cause) and of the
    pre-spike weights (the oldest snapshot kept, `oldest`, else `snapshot`'s: within a rollback's reach, the state
    furthest from a cause that began a few updates ago): unseen_verdict. Without an unseen batch (the end of the
    data), the suspect batch on the snapshot's model decides, on the loss's sign alone. The diagnosis says which
    comparison decided ("decided_by"), and asks, when the unseen batch is as far off on the pre-spike weights, for
    the trend to be re-based ("rebase": a regime change, not a fault of the weights)."""
    then, payload = snapshot
    rng_after, unseen = ask_unseen(other)
    old = loss_on(model, payload[0], forward)
    checkpoint.set_rng_state(rng_after)
    trend = Series(guard.rules.spike_guard_window)
    trend.load(snapshot_stats(payload).get("loss"))
    expected_then, expected_now = trend.expected(), guard.series["loss"].expected()
    excess_now = replay.loss - expected_now if math.isfinite(replay.loss) else math.inf
    excess_then = (
        old - expected_then if expected_then is not None and math.isfinite(old) else math.inf
    )
    evidence = (
        f"{replayed}; the batch on the model of iteration {then}: loss {old:.4g}, "
        f"{excess_then:+.3g} against its trend, now {excess_now:+.3g}"
    )
    diagnosis = {"since": then}
    if unseen is not None:
        first, weights = oldest or snapshot
        data, diagnosis["decided_by"], words, rebase = unseen_verdict(
            guard, model, weights[0], first, excess_now, rng_after, *unseen
        )
        evidence += words
        if rebase is not None:
            diagnosis["rebase"] = rebase
    else:  # no unseen batch to ask: the older model's answer, on the loss's sign alone
        data = (
            excess_then >= 0.5 * excess_now if math.isfinite(excess_now) else not math.isfinite(old)
        )
        diagnosis["decided_by"] = f"the batch on the model of iteration {then}"
    diagnosis["cause"] = "data" if data else "optimizer"
    if data and per_sample is not None:
        suspects, rest = minority(per_sample())
        if suspects:
            expected = expected_now if expected_now is not None else math.nan
            evidence += (
                f"; {len(suspects)} samples far from the others (positions {', '.join(map(str, suspects))}), "
                f"the batch without them: loss {rest:.4g}, trend {expected:.4g}"
            )
            diagnosis["suspects"] = suspects
    diagnosis["evidence"] = (
        evidence
        + f"; decided by {diagnosis['decided_by']}: the "
        + ("batch is the outlier" if data else "batch is ordinary, the weights are not")
    )
    return diagnosis


def loss_on(model, weights, forward):
    """forward() on the model with these weights (a snapshot's), the live weights put back after."""
    gpt = parallel.unwrap(model)
    live = {k: v.detach().to("cpu", copy=True) for k, v in gpt.state_dict().items()}
    gpt.load_state_dict(weights)
    loss = forward()
    gpt.load_state_dict(live)
    return loss


def unseen_verdict(guard, model, weights, then, excess_now, rng_after, step, label, forward):
    """(is the suspect batch the cause, the comparison that decided, the evidence's words, the (loss, grad norm) to
    re-base the trend to or None), from an unseen batch (label) computed on these weights (step: never applied) and,
    when it spikes there too, its loss on the pre-spike weights (forward() on the snapshot's weights):
      the unseen batch ordinary here         -> data: this batch is the cause
      this batch's loss far below the unseen one's (less than half as far above the trend)
                                             -> data: weights a fault damaged do not predict text better than
                                                text they never saw (repeated text, one token over and over)
      off its trend too (a spike, or its loss half the bar above), and as far off on the pre-spike weights (more
      than half of its excess was there already) -> data, a regime change: the trend is stale, not the weights
      off its trend too, and worse than on the pre-spike weights -> optimizer: the updates since did it
      off its trend too, no pre-spike weights (weights None: without_snapshot)
                                             -> optimizer, with the unseen batch's numbers
    Judged without touching the guard's reason for the step under investigation."""
    pending, alone, half = guard.pending, guard.grad_norm_alone, guard.rules.spike_guard_zscore / 2
    spike_there = (
        not math.isfinite(step.loss)
        or not math.isfinite(step.grad_norm)
        or bool(guard.judge(step.loss, step.grad_norm))
        or guard.series["loss"].judge(step.loss)[0] > half
    )
    guard.pending, guard.grad_norm_alone = pending, alone
    words = (
        f"; {label} on these weights: loss {step.loss:.4g}, grad norm {step.grad_norm:.4g}, "
        + ("off its trend too" if spike_there else "ordinary")
    )
    if not spike_there:
        return True, f"{label} on these weights", words, None
    if not (math.isfinite(step.loss) and math.isfinite(step.grad_norm)):  # no batch's fault
        return False, f"{label} on these weights", words + ": the weights are broken", None
    off = step.loss - guard.series["loss"].expected()
    if excess_now < 0.5 * off:
        return True, f"{label} on these weights (this batch lies far below it)", words, None
    if weights is None:  # no snapshot yet (without_snapshot): no older weights to ask
        return False, f"{label} on these weights", words, (step.loss, step.grad_norm)
    before = loss_on(model, weights, forward)
    checkpoint.set_rng_state(rng_after)
    worse = step.loss - before if math.isfinite(before) else -math.inf
    words += f"; on the model of iteration {then}: loss {before:.4g} ({worse:+.3g} since)"
    decided = f"{label} on the model of iteration {then}"
    if worse <= 0.5 * off:
        return (
            True,
            decided,
            words + ", as far off: the trend is stale",
            (step.loss, step.grad_norm),
        )
    return False, decided, words + ": the weights got worse", None


def reproduced_tolerance(noise):
    """The relative difference between a spike and its replay still called the same: 16x the run's own measured
    nondeterminism (None: not measured yet), and never under 1e-6 (CPU and deterministic kernels: bit for bit)."""
    return max(16 * (noise or 0.0), 1e-6)


def minority(losses, spread=4.0):
    """([positions], mean loss of the others): the samples of a batch whose losses lie more than `spread` robust
    scatters (1.4826 x the median absolute deviation) from the batch's median, on either side, if they are a
    minority; ([], mean) when none or most are (then the whole batch is the suspect)."""
    values = sorted(losses)
    n = len(values)
    if n < 3:
        return [], sum(values) / max(n, 1)
    median = values[n // 2]
    mad = sorted(abs(v - median) for v in values)[n // 2]
    bar = max(spread * 1.4826 * mad, 0.05 * abs(median))
    far = [i for i, v in enumerate(losses) if abs(v - median) > bar]
    if not far or 2 * len(far) >= n:
        return [], sum(values) / n
    kept = [v for i, v in enumerate(losses) if i not in far]
    return far, sum(kept) / len(kept)


@torch.no_grad()
def corrupted_weights(guard, model, optimizer, iteration, then, payload, say=True):
    """(DP rank, evidence) when some rank holds a weight the optimizer cannot have written since
    the snapshot of iteration `then`, else None; say: the rank that holds it prints which weight. A
    weight may move by at most 2 x (sum of the LRs applied since) x (guard.step_bound, the most one
    step of the optimizer moves a weight in LR units, + weight decay x |weight|), plus the rounding
    of its dtype; one that moved farther (or is not finite) was written by something else: a bit
    flipped in memory. One all-reduce over all ranks of one number per DP rank, so every rank names
    the same DP rank (the corrupted weight may be on any TP or PP rank of it)."""
    g, stats = parallel.grid, snapshot_stats(payload)
    # a checkpoint written before the guard summed its LRs, or an optimizer whose entry declares no
    # bound (a fork's; Adam's is infinite when beta1^2 >= beta2): nothing to test against
    if "lr sum" not in stats or guard.step_bound is None:
        return None
    lr_sum = max(guard.lr_sum - stats["lr sum"], 0.0)
    move = 2 * lr_sum * guard.step_bound
    if not math.isfinite(move):
        return None
    decay = max([group.get("weight_decay", 0.0) for group in optimizer.param_groups] or [0.0])
    worst, where = farthest_move(
        model, payload[0], move, 2 * max(lr_sum, max(iteration - 1 - then, 1)) * decay
    )
    ratios = torch.zeros(g.dp_size, dtype=torch.float64, device=next(model.parameters()).device)
    ratios[g.dp_rank] = worst
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ratios, op=dist.ReduceOp.MAX)
    ratios = ratios.tolist()
    if max(ratios) <= 1:
        return None
    rank = max(range(g.dp_size), key=ratios.__getitem__)
    if say and where is not None and worst > 1:  # the rank that holds it says which weight
        name, i, before, now = where
        print(
            f"spike guard: iteration {iteration}: on rank {g.rank}, weight {name}[{i}] is {now:.4g}, was "
            f"{before:.4g} at iteration {then}",
            flush=True,
        )
    return rank, (
        f"a weight of DP rank {rank} moved {ratios[rank]:.3g}x farther since iteration {then} "
        f"than the optimizer can move it at the LRs applied since (summed: {lr_sum:.3g}): "
        "written by something else"
    )


@torch.no_grad()
def farthest_move(model, weights, move, decay):
    """(the largest ratio of a weight's move since `weights` to what the optimizer can have moved it, (name, index,
    then, now) of that weight): at most `move`, plus `decay` x |weight| of weight decay, plus its dtype's rounding."""
    # elements compared at a time: a few fp32 temporaries of 64 MiB
    worst, where, chunk = 0.0, None, 2**24
    for name, p in parallel.unwrap(model).named_parameters():
        if name not in weights:
            continue
        for k in range(0, p.numel(), chunk):
            before = weights[name].view(-1)[k : k + chunk].to(p.device, torch.float32)
            now = p.detach().view(-1)[k : k + chunk].float()
            allowed = (
                move
                + decay * before.abs()
                + 4 * torch.finfo(p.dtype).eps * (before.abs() + move)
                + torch.finfo(torch.float32).tiny
            )
            ratio = torch.where(torch.isfinite(now), (now - before).abs() / allowed, math.inf)
            i = int(ratio.argmax())
            if ratio[i] > worst:
                worst, where = float(ratio[i]), (name, k + i, float(before[i]), float(now[i]))
    return worst, where


def replay_in_fp32(guard, rng_before, model, optimizer, rerun):
    """The step replayed in fp32 (Fp32Step: the master weights, fp32 gradients, no loss scale), judged
    against the trend. Applied if it is ordinary; else the half-precision run is left exactly as it was (its
    weights, masters, optimizer, loss scaler and RNG streams, and the reason the guard gives)."""
    rng_after, pending, unseen = checkpoint.rng_state(), guard.pending, guard.unseen
    checkpoint.set_rng_state(rng_before)
    # measured in half precision, with the fault if it persists: no bar for an fp32 loss
    guard.unseen = None
    with Fp32Step(model, optimizer) as fp32:
        exact = rerun(
            guard.judge if guard.armed() else None,
            optim.LossScaler(dynamic=False, static_scale=1.0),
        )
        fp32.keep = exact.outcome == "ok"
    guard.pending, guard.unseen = pending, unseen  # the spike's reason is the half-precision step's
    if not fp32.keep:
        checkpoint.set_rng_state(rng_after)
    return exact


class Fp32Step:
    """One step of a half-precision model run in fp32, for the spike guard's numerical diagnosis (a spike that an
    fp32 replay of the same step does not have, docs/spike_guard.md):

        with Fp32Step(model, optimizer) as fp32:
            step = whole_step(model, optimizer, no_loss_scale, ...)
            fp32.keep = step.outcome == "ok"

    Inside, the model's weights are fp32 copies of its master weights (its gradients are accumulated in fp32 in
    every precision: precision.grad_dtype), so the forward, backward and optimizer step are those of an fp32 run
    from the same state. On leaving, with `keep`, the weights
    are the masters rounded into the half-precision tensors, as MixedPrecisionOptimizer.step rounds them;
    without, the half-precision tensors are back untouched, bit for bit. Costs, for that one step, an fp32 copy
    of the weights, 4 bytes per parameter, and activations at fp32's size."""

    def __init__(self, model, optimizer):
        self.gpt, self.optimizer, self.keep = parallel.unwrap(model), optimizer, False

    def __enter__(self):
        # fp32 means fp32: TF32 matmuls (Ampere on) keep a 10-bit mantissa, as little as fp16's
        self.tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        params = [p for p in self.gpt.parameters() if p.dtype != torch.float32]
        self.half = {p: p.data for p in params}
        for p, master in zip(params, master_weights(params, self.optimizer)):
            p.data = master
        return self

    @torch.no_grad()
    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.tf32
        for p, half in self.half.items():
            if self.keep and exc[0] is None:
                half.copy_(p.data)
            p.data = half


@torch.no_grad()
def master_weights(params, optimizer):
    """Copies of the fp32 master weights of these model parameters, on this rank; under ZeRO-1 each broadcast over
    DP by the rank that holds it, as ZeroShardedOptimizer.step broadcasts the weights it updated."""
    copies = []
    for p in params:
        main = optimizer.main_param(p)
        if main is None:  # another DP rank's (ZeRO-1): broadcast below
            main = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        copies.append(main.detach().clone())
    if isinstance(optimizer, parallel.ZeroShardedOptimizer):
        optimizer.broadcast(dict(zip(params, copies)))
    return copies


@torch.no_grad()
def evaluate_batches(model, batches, core, device):
    """The mean loss of these micro-batches in train mode (dropout on, as in the trend it is compared with: eval
    mode would bias it low); the caller restores the RNG streams the dropout draws from."""
    loss = training.forward_backward(
        model, batches, loader.packing(core), device, forward_only=True
    )
    return parallel.average_loss(loss).item()


# -----------------------------------------------------------------------------
# Naming the input behind a spike


@torch.no_grad()
def sample_losses(model, batches, core):
    """The loss of each sample of this global batch (in global batch order), one forward without dropout, with the
    run's packed-document inputs and loss mask (loader.packing) as its training sees them; all ranks take part
    (PP=1 only: a pipeline returns no per-sample losses)."""
    g, mbs, packing = parallel.grid, core.micro_batch_size, loader.packing(core)
    device = batches[0][0].device
    losses = torch.zeros(len(batches) * mbs * g.dp_size, device=device)
    was_training = model.training
    model.eval()
    for k, (x, y) in enumerate(batches):
        inputs = packing(x) if packing else {}
        mask = inputs.pop("loss_mask", None)
        per_token = parallel.vocab_parallel_cross_entropy(model(x, **inputs), y, core.vocab_size)[
            0
        ].float()
        per_sample = (
            per_token.mean(dim=1)
            if mask is None
            else (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        )
        start = k * mbs * g.dp_size + g.dp_rank * mbs
        losses[start : start + mbs] = per_sample
    model.train(was_training)
    if g.dp_group is not None and g.dp_size > 1:
        dist.all_reduce(losses, group=g.dp_group)  # each sample's slot is filled by one DP rank
    return losses


def highest_loss_samples(model, batches, first_sample, core, count=3, positions=None):
    """[(loss, sample index)] of the `count` samples with the highest loss in this global batch (or of those at
    `positions` in it: a minority the diagnosis found, low losses included)."""
    losses = sample_losses(model, batches, core)
    if positions:
        return [(float(losses[i]), first_sample + i) for i in positions]
    top = torch.topk(losses, min(count, losses.numel()))
    return [(loss, first_sample + i) for loss, i in zip(top.values.tolist(), top.indices.tolist())]


# in save: the documents of the samples behind data-driven spikes
SKIP_LIST = "skip_documents.jsonl"


def name_samples(model, batches, first_sample, core, dataset, seqlen, iteration, decision=None):
    """Print (and return) the highest-loss samples of a spiking batch, decoded. When the diagnosis says the data
    did it (decision's cause "data"), their documents go to the skip list SAVE/skip_documents.jsonl too
    (skip_list.py's format), which skip_documents=FILE makes the data leave out."""
    import data

    if parallel.grid.pp_size > 1:
        print0(
            f"spike guard: iteration {iteration}: samples {first_sample}-{first_sample + core.global_batch_size - 1}"
            " (not ranked by loss with pipeline parallelism; tools/show_samples.py decodes them)"
        )
        return []
    named = highest_loss_samples(
        model, batches, first_sample, core, positions=(decision or {}).get("suspects")
    )
    records = []
    for loss, index in named:
        print0(
            f"spike guard: iteration {iteration}: sample {index} (loss {loss:.3f}): "
            f"{data.sample_text(dataset, index, seqlen, 160, core.tokenizer_file)!r}"
        )
        prefix, component, pieces = skip_list.sample_documents(dataset, index, seqlen + 1)
        records.append(
            {
                "iteration": iteration,
                "sample": index,
                "loss": round(loss, 4),
                "dataset": prefix,
                "dataset_index": component,
                "documents": [d for d, _ in pieces],
                "tokens": [n for _, n in pieces],
            }
        )
    if (decision or {}).get("cause") == "data" and core.save and records:
        to_skip_list(os.path.join(core.save, SKIP_LIST), records, iteration)
    return named


def to_skip_list(path, records, iteration):
    """The documents of a data spike's samples appended to the skip list at path (by rank 0), and said."""
    if parallel.grid.rank == 0:
        skip_list.append(path, records)
    by_dataset = {}
    for r in records:
        ids = by_dataset.setdefault(r["dataset"], [])
        ids += [d for d in r["documents"] if d not in ids]
    docs = "; ".join(f"{prefix}: {', '.join(map(str, ids))}" for prefix, ids in by_dataset.items())
    print0(
        f"spike guard: iteration {iteration}: the documents of these samples ({docs}) appended to the skip "
        f"list {path}; to train without them, set skip_documents={path} (a new run, or a resume from a "
        "checkpoint before the spike)"
    )
