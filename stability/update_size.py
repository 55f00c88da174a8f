"""The spike guard's reading of what the optimizer did: the weights' move per update, relative to their norm, between
the newest snapshot and now (docs/spike_guard.md, section 1, "Why the weights' move per update").

    move = relative_move(model, snapshot_weights, updates)   # ||w_now - w_then|| / ||w_now|| / updates

An LR tens of times too high (a resume that lost its LR schedule, a config typo) or a corrupted optimizer state can
harm a run for hundreds of iterations without one loss spike: the fourth campaign's LRs x13-x35 after a resume cost
1.4-2.6% of final loss and no loss rule saw them. The weights' move is the optimizer's own doing, whatever the cause,
and the LR schedule moves it smoothly; the guard judges it against its own trend (Detector.moved). It reads the
weights only, never the LR: a rule that compared the LR with the schedule would test the schedule, not the run.

Cost: at each snapshot (every spike_guard_snapshot_interval iterations), one pass over this rank's weights against
the snapshot's host copy (as the snapshot itself is one pass), in chunks of 2^24 elements, and one all-reduce of two
numbers over all ranks on the weights' device. Each rank sums only its parameters of parallel.counted_once, so TP and
PP shards add up to the whole model once (a TP-replicated LayerNorm or the last stage's copy of the tied embedding
counted twice would make a TP2 or PP2 run, or a resharded resume, read another move on the same weights); DP replicas
(ZeRO-1's too: they hold whole weights) each add the same, which the ratio cancels. No memory beyond the snapshots
the guard keeps anyway.

With the snapshots off (spike_guard_snapshot_interval=0: a rollback returns to a disk checkpoint), the reading comes
at each disk checkpoint, against a sampled copy of the weights taken at the one before (sample(): every stride-th
element, at most SAMPLE of them a rank, on the weights' device): a screen with no memory to speak of and no read of
the disk. Only a reading over the bar reads the checkpoint itself, which the guard's decision then rests on
(Guard.update_size). The eighth campaign's two LR faults that went unseen without snapshots (trials 57 and 58 of
eighth-disk) had no reading at all.
"""

import math

import torch
import torch.distributed as dist

import parallel

CHUNK = 2**24  # elements compared at a time: a few fp32 temporaries of 64 MiB
# a sampled copy's elements a rank: 16 MiB of fp32 (3,656 elements read the move within 0.7-1.5%: at 2^22, by
# 1/sqrt(n), about 0.04%, extrapolated)
SAMPLE = 2**22


@torch.no_grad()
def relative_move(model, weights, updates, stride=1):
    """||w_now - w_then|| / ||w_now|| / updates over the parameters of `weights` (a snapshot's model state, keyed by
    name; or sample()'s elements, every `stride`-th), each counted once over the model-parallel group
    (parallel.counted_once) and summed over every rank; inf when a weight is not finite."""
    gpt = parallel.unwrap(model)
    device = next(gpt.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    once = {id(p) for p in parallel.counted_once(gpt)}
    for name, p in gpt.named_parameters():
        if id(p) not in once or name not in weights:
            continue
        flat, then = p.detach().view(-1)[::stride], weights[name].view(-1)
        # a sampled parameter weighs as all its elements: a LayerNorm's 2 of 64 would weigh as a matrix's 1 in 37
        weight = p.numel() / flat.numel()
        for k in range(0, flat.numel(), CHUNK):
            now = flat[k : k + CHUNK].float()
            sums[0] += weight * (
                (now - then[k : k + CHUNK].to(device, torch.float32))
                .square()
                .sum(dtype=torch.float64)
            )
            sums[1] += weight * now.square().sum(dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    moved, norm = sums.sqrt().tolist()
    if not math.isfinite(moved) or not math.isfinite(norm):
        return math.inf
    return moved / max(norm, 1e-30) / max(updates, 1)


@torch.no_grad()
def sample(model, size=SAMPLE):
    """(weights, stride): every stride-th element of each parameter this rank counts (parallel.counted_once),
    copied on the weights' device, for relative_move(..., stride). The stride is this rank's elements / size,
    rounded up to a prime, so that it does not fall in step with a row's length and read one column of a matrix;
    1 (every element, the reading a snapshot gives) where they are fewer than size."""
    gpt = parallel.unwrap(model)
    counted = list(parallel.counted_once(gpt))
    stride = next_prime(math.ceil(sum(p.numel() for p in counted) / size))
    once = {id(p) for p in counted}
    weights = {
        name: p.detach().view(-1)[::stride].clone()
        for name, p in gpt.named_parameters()
        if id(p) in once
    }
    return weights, stride


def next_prime(n):
    """The smallest prime >= n (1 for n <= 1: no sampling)."""
    if n <= 1:
        return 1
    while any(n % k == 0 for k in range(2, math.isqrt(n) + 1)):
        n += 1
    return n
