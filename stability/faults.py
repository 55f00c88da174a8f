"""Fault injection: spikes made on purpose, to test the spike guard (Megatron-LM's --error-injection-*).

    inject_bad_batch_iters   random token ids in place of those iterations' batches (data: they come back when
                             the iterations are run again)
    inject_degenerate_iters  degenerate batches (inject_degenerate_kind): one repeated token, a repeated 8-gram,
                             or random tokens in a minority (inject_degenerate_fraction) of the samples
    inject_lr_iters          their LR x inject_lr_factor (with inject_lr_persistent: on every pass, as a resume
                             with a higher LR would be; else once in time)
    inject_bitflip_iters     a bit of a reduced gradient, of a weight after the update, or of the optimizer's state
                             after the update (an Adam moment, an fp32 master: inject_bitflip_target), flips on rank
                             inject_bitflip_rank
    inject_numerical_iters   a cancellation that half precision loses and fp32 keeps
    inject_lost_optimizer_state_iter  Adam's moments zeroed before that iteration's step, the step count kept (a
                             resume whose checkpoint lost them: the first updates divide by a near-zero second moment)
    inject_repeat_iters      a block of repeated documents met in corpus order: the block's iterations given the
                             samples of its first inject_repeat_period iterations again, in turn
    inject_overflow_iters    fp16: every step of these iterations overflows, whatever the loss
                             scale (on every pass: it lives in the weights and data, as a real
                             burst does)

Faults that stay where they live (the seventh campaign's, lab/campaign_draw.py):

    inject_bad_samples      consumed-sample index ranges bad IN THE CORPUS
                            (inject_bad_samples_kind: random tokens, one token repeated, an 8-gram,
                            or a duplicate of the range's first inject_duplicate_period samples):
                            whichever iteration reads those samples -- the first pass, a rollback's
                            replay, a resume, the guard's comparison batch -- meets them again; only
                            a skip of those samples (an iteration range drawn and thrown away)
                            removes them. Part of a batch's samples in the range: that part is bad.
    inject_bad_device_iter  inject_bitflip_rank's device goes bad at the first pass through this
                            iteration and stays bad: every step it runs from then on (bit
                            inject_bitflip_bit of element inject_bitflip_element of the first
                            matrix's reduced gradient) is corrupted, whatever its iteration.
                            A rollback to before the onset does not heal it (its replays are
                            corrupted too), nor does a re-sync of the replicas (the next step
                            corrupts again), nor a resume (a resumed run past the onset is on the
                            bad device from its first step). Only taking the device out ends it: the
                            guard's stop at its hardware cap, the operator's restart without the
                            node.

An LR spike (not inject_lr_persistent) and an inject_bitflip_iters flip are events in time: a replay
or a rollback does not meet them again (a transient hardware fault: one step). The spike guard keeps
the run's timeline (spike_guard.SpikeGuard.meets_fault), and is told of the LRs a replay would not
get (note_lr). The data faults keyed by iteration (inject_bad_batch_iters, inject_degenerate_iters,
inject_repeat_iters) stay for the first six campaigns' draws and their tests: their iteration is
their samples only while no skip list moves the data. The ranges are parsed once, when the run
starts.
"""

from dataclasses import dataclass

import torch

import loader
import parallel
import schedule
import training
from report import print0


@dataclass
class FaultsConfig:  # Faults
    # -- stability: fault injection --
    # fault injection: iterations ("40-45") given random-token batches
    inject_bad_batch_iters: list[str] | None = None
    # fault injection: iteration ranges whose LR is x inject_lr_factor
    inject_lr_iters: list[str] | None = None
    inject_lr_factor: float = 100.0  # the LR multiplier of inject_lr_iters
    # inject_lr_iters on every pass (a resume with a higher LR), not once in time
    inject_lr_persistent: bool = False
    # fault injection: iterations given degenerate batches ...
    inject_degenerate_iters: list[str] | None = None
    # ... one token repeated ("repeat"), an 8-gram ("ngram"), or "minority":
    inject_degenerate_kind: str = "repeat"
    inject_degenerate_fraction: float = 0.25  # ... random tokens in this fraction of the samples
    # fault injection: flip a bit of one gradient element at these iters
    inject_bitflip_iters: list[str] | None = None
    # ... on this rank, after the DP all-reduce (a faulty GPU: silent data corruption)
    inject_bitflip_rank: int = 0
    # ... of a gradient ("grad"), a weight, "exp_avg", "exp_avg_sq" or "master"
    inject_bitflip_target: str = "grad"
    inject_bitflip_bit: int = -1  # ... this bit of the element (-1: the top exponent bit)
    # ... this element of the first matrix (-1: its largest in magnitude)
    inject_bitflip_element: int = -1
    # fault injection: a cancellation only half precision loses
    inject_numerical_iters: list[str] | None = None
    # fault injection: Adam's moments zeroed before this step
    inject_lost_optimizer_state_iter: int | None = None
    # fault injection: a block of repeated documents in corpus order ...
    inject_repeat_iters: list[str] | None = None
    # ... its iterations given again the samples of its first this many iterations
    inject_repeat_period: int = 1
    inject_overflow_iters: list[str] | None = None  # fault injection (fp16): gradients overflow
    # fault injection: sample ranges ("0-7") bad in the corpus ...
    inject_bad_samples: list[str] | None = None
    # ... random tokens, "repeat", "ngram" or "duplicate" ...
    inject_bad_samples_kind: str = "random"
    inject_duplicate_period: int = 8  # ... of the range's first this many samples, in turn
    # fault injection: inject_bitflip_rank's device bad from here on
    inject_bad_device_iter: int | None = None

    # keys read only while a switch is on (sections.py): each fault's settings, read while it is injected
    SWITCHED = {
        "inject_lr_iters": ("inject_lr_factor", "inject_lr_persistent"),
        "inject_degenerate_iters": ("inject_degenerate_kind", "inject_degenerate_fraction"),
        "inject_bitflip_iters": ("inject_bitflip_target",),
        # a bad device flips inject_bitflip_bit of its gradient's element at every step from its onset
        "inject_bitflip_iters|inject_bad_device_iter": (
            "inject_bitflip_rank",
            "inject_bitflip_bit",
            "inject_bitflip_element",
        ),
        "inject_repeat_iters": ("inject_repeat_period",),
        "inject_bad_samples": ("inject_bad_samples_kind", "inject_duplicate_period"),
    }


SAMPLE_KINDS = ("random", "repeat", "ngram", "duplicate")  # inject_bad_samples_kind's names


def sample_ranges(ranges, key):
    """["0-7", "96-99"] -> [(0, 7), (96, 99)]: consumed-sample indices (0-based, inclusive: the
    first sample of the run is 0, as loader.sample_indices counts them)."""
    return schedule.parse_iteration_ranges(
        ranges, key, lowest=0, unit="consumed-sample indices, 0-based and inclusive, e.g. 96-103"
    )


def bitflip_width(target, half):
    """The width in bits of the element inject_bitflip_target flips: a weight is in the run's
    precision (fp16, bf16: 16 bits); gradients (accumulated in fp32: precision.grad_dtype), Adam's
    moments and the masters are fp32. half: the run is fp16 or bf16."""
    return 16 if target == "weight" and half else 32


class Faults(training.Callback):
    """The configured faults, asked at each iteration whether they strike it. As a callback: the batch and LR
    replaced before the step, a gradient bit flipped after the all-reduce, the numerical fault's hook on during
    the step (and its replays), a weight bit flipped after an applied step."""

    Config = FaultsConfig  # its section: stability.build_callbacks builds it with it

    name = "faults"

    def __init__(self, faults_cfg, shared, seed, vocab_size, core=None):
        """seed: its generators are seeded by (seed, iteration); vocab_size: random tokens are drawn
        from it; core: the core's keys (stability.CoreKeys) loader.micro_batches reads, for the
        repeated block's samples."""
        self.faults_cfg, self.seed, self.vocab_size, self.core = faults_cfg, seed, vocab_size, core
        # the run's timeline (the guard's): which passes meet an event in time
        self.timeline = shared.guard if shared is not None else NoTimeline()
        self.numerical_hook = self.flip_grad = self.flip_weight = self.flip_state = None
        parse = schedule.parse_iteration_ranges
        self.bad_batch_ranges = parse(faults_cfg.inject_bad_batch_iters, "inject_bad_batch_iters")
        self.lr_ranges = parse(faults_cfg.inject_lr_iters, "inject_lr_iters")
        self.bitflip_ranges = parse(faults_cfg.inject_bitflip_iters, "inject_bitflip_iters")
        self.numerical_ranges = parse(faults_cfg.inject_numerical_iters, "inject_numerical_iters")
        self.degenerate_ranges = parse(
            faults_cfg.inject_degenerate_iters, "inject_degenerate_iters"
        )
        self.repeat_ranges = parse(faults_cfg.inject_repeat_iters, "inject_repeat_iters")
        self.overflow_ranges = parse(faults_cfg.inject_overflow_iters, "inject_overflow_iters")
        self.overflow_hook = None  # this iteration's steps overflow (inject_overflow_iters)
        self.bad_sample_ranges = sample_ranges(faults_cfg.inject_bad_samples, "inject_bad_samples")
        self.device_bad = False  # inject_bad_device_iter's onset has come: the device stays bad

    def before_step(self, it):
        n = it.number
        it.batches = self.data_batches(n, it.first_sample, it.batch_size, it.seqlen, it.batches)
        factor = self.lr_factor(n, self.timeline)
        if factor != 1.0:
            # once in time: a replay of this iteration would not meet it
            if not self.faults_cfg.inject_lr_persistent:
                self.timeline.note_lr(n, it.lr, it.lr * factor)
            it.lr = it.lr * factor
        self.numerical_hook = self.numerical(n, self.model)
        self.flip_weight = self.bitflip(n, self.timeline, "weight")
        device = self.bad_device(n)  # its onset noted whatever else strikes this iteration
        self.flip_grad = self.bitflip(n, self.timeline, "grad") or device
        self.flip_state = self.state_bitflip(n, self.timeline)
        self.lose_optimizer_state(n, self.timeline)
        self.overflow_hook = self.overflow(n, self.model)

    def start(self, parts, report, train_data):
        self.model, self.optimizer, self.train_data = parts.model, parts.optimizer, train_data
        for line in self.after_the_end(parts.schedule.total_iters, parts.schedule.total_samples):
            print0(line)

    def after_the_end(self, total_iters, total_samples):
        """A warning line for each fault that starts after the run's last iteration (or sample): a longer run's
        fault kept in a config struck nothing, in silence."""
        f, lines = self.faults_cfg, []
        for key in [
            k for k in vars(f) if k.startswith("inject_") and k.endswith(("_iters", "_iter"))
        ]:
            texts = getattr(f, key)
            if texts is None or texts == []:
                continue
            starts = (
                [texts]
                if isinstance(texts, int)
                else [r[0] for r in schedule.parse_iteration_ranges(texts)]
            )
            if min(starts) > total_iters:
                lines.append(
                    f"warning: {key} starts after the run's last iteration {total_iters}: it strikes nothing"
                )
        if self.bad_sample_ranges and self.bad_sample_ranges[0][0] >= total_samples:
            lines.append(
                f"warning: inject_bad_samples starts after the run's {total_samples} samples: it strikes nothing"
            )
        return lines

    def on_grads(self, model, loss_scale):
        if self.flip_grad is not None:
            self.flip_grad(model)

    def after_step(self, it, step):
        # the numerical fault stayed on for the step's replays (diagnosis.investigate); the weight flips after
        # the step that stands, before the guard's decision and the snapshot see it
        if self.numerical_hook is not None:
            self.numerical_hook.remove()
        if self.flip_weight is not None and step.outcome == "ok":
            self.flip_weight(self.model)
        if self.flip_state is not None and step.outcome == "ok":
            self.flip_state()
        if self.overflow_hook is not None:
            self.overflow_hook.remove()
        self.numerical_hook = self.flip_weight = self.flip_grad = self.flip_state = None
        self.overflow_hook = None
        return False

    def data_batches(self, iteration, first_sample, batch_size, seqlen, batches):
        """The batches of this iteration as the data gives them, its data faults in (bad,
        degenerate, repeated): the training step's, and the spike guard's comparison batch of a
        later iteration (guard.comparison) -- a data fault is in the corpus, whoever reads it."""
        batches = self.degenerate_batches(iteration, self.bad_batches(iteration, batches))
        batches = self.repeated_batches(iteration, first_sample, batch_size, seqlen, batches)
        return self.corpus_batches(first_sample, batches)

    def generator(self, iteration, ranges, salt):
        """A CPU generator seeded by (seed, iteration) when the iteration is in the ranges, else None."""
        if not schedule.in_ranges(iteration, ranges):
            return None
        return torch.Generator().manual_seed(self.seed * salt + iteration)

    def bad_batches(self, iteration, batches):
        """Random token ids in place of the batches of inject_bad_batch_iters, drawn from a generator seeded by
        (seed, iteration): the same on every rank and every resume, and no draw from the training RNG streams."""
        gen = self.generator(iteration, self.bad_batch_ranges, 1_000_003)
        if gen is None:
            return batches
        out = []
        for x, y in batches:
            tokens = torch.randint(0, self.vocab_size, (x.shape[0], x.shape[1] + 1), generator=gen)
            out.append((tokens[:, :-1].to(x.device), tokens[:, 1:].to(y.device)))
        return out

    def degenerate_batches(self, iteration, batches):
        """The batches of inject_degenerate_iters made degenerate (inject_degenerate_kind), from a generator seeded
        by (seed, iteration) as bad_batches: "repeat" -- every sample its commonest token repeated (tr8-104B's
        backslash-only samples: a loss far below the trend, a grad norm far above it); "ngram" -- an 8-gram repeated;
        "minority" -- random tokens in the first inject_degenerate_fraction of each micro-batch's samples."""
        faults_cfg, gen = (
            self.faults_cfg,
            self.generator(iteration, self.degenerate_ranges, 1_000_033),
        )
        if gen is None:
            return batches
        out = []
        for x, y in batches:
            rows, length = x.shape[0], x.shape[1] + 1
            if faults_cfg.inject_degenerate_kind == "repeat":
                # each sample's commonest token (a space, a newline: what a model predicts best) over and over
                tokens = torch.mode(x.cpu(), dim=1).values[:, None].expand(rows, length)
            elif faults_cfg.inject_degenerate_kind == "ngram":
                gram = torch.randint(0, self.vocab_size, (rows, 8), generator=gen)
                tokens = gram.repeat(1, length // 8 + 1)[:, :length]
            else:
                tokens = torch.cat([x[:, :1].cpu(), y.cpu()], dim=1)
                bad = max(1, round(faults_cfg.inject_degenerate_fraction * rows))
                tokens[:bad] = torch.randint(0, self.vocab_size, (bad, length), generator=gen)
            tokens = tokens.contiguous()
            out.append((tokens[:, :-1].to(x.device, x.dtype), tokens[:, 1:].to(y.device, y.dtype)))
        return out

    def lr_factor(self, iteration, guard):
        """inject_lr_factor in the first pass through inject_lr_iters (on every pass with inject_lr_persistent:
        then it is the schedule's, and a replay meets it too), else 1."""
        if self.faults_cfg.inject_lr_persistent:
            return (
                self.faults_cfg.inject_lr_factor
                if schedule.in_ranges(iteration, self.lr_ranges)
                else 1.0
            )
        return (
            self.faults_cfg.inject_lr_factor
            if guard.meets_fault(iteration, self.lr_ranges)
            else 1.0
        )

    def bitflip(self, iteration, guard, target="grad"):
        """The fault of inject_bitflip_iters (or None), when inject_bitflip_target is `target`: on rank
        inject_bitflip_rank a bit of an element of the first matrix flips (inject_bitflip_bit, _element; by default
        the top exponent bit of the largest element) (x 2^128 for a
        value under 2 in fp32) -- in its reduced gradient ("grad": called after the DP all-reduce), or in the
        weight itself after the update ("weight": the next step computes with it). Once in time: not in a replay,
        nor when the iteration is run again."""
        faults_cfg = self.faults_cfg
        if faults_cfg.inject_bitflip_target != target or not (
            guard.meets_fault(iteration, self.bitflip_ranges)
            and parallel.grid.rank == faults_cfg.inject_bitflip_rank
        ):
            return None

        @torch.no_grad()
        def flip(model):
            params = [p for p in parallel.unwrap(model).parameters() if p.dim() == 2]
            flat = (parallel.main_grad(params[0]) if target == "grad" else params[0].data).view(-1)
            self.flip_bit(flat, iteration, "gradient" if target == "grad" else "weight")

        return flip

    def numerical(self, iteration, model):
        """The fault of inject_numerical_iters: a hook on the final LayerNorm (its handle, to remove after the
        iteration; None outside those iterations and off the last pipeline stage) that adds 4096 x max|x| to its
        input. LayerNorm subtracts the mean, so the function is the same -- but the sum keeps 24 - 12 bits of x in
        fp32 and none in bf16 (8 bits) or fp16 (11 bits; past 65504, when max|x| > 16, it overflows): catastrophic
        cancellation. It stands for any computation that half precision loses and fp32 keeps (an overflow, an
        absorbed small update); not for a particular one. A replay in the same precision reproduces it; the
        guard's fp32 replay computes it right."""
        ln_f = getattr(parallel.unwrap(model), "ln_f", None)
        if ln_f is None or not schedule.in_ranges(iteration, self.numerical_ranges):
            return None

        def cancel(module, args):
            x = args[0]
            return (x + 4096 * x.detach().abs().amax(), *args[1:])

        return ln_f.register_forward_pre_hook(cancel)

    # -- bit flips in the optimizer's state (what the DP replica check, replica_check.py, must see) ----------------

    def state_bitflip(self, iteration, guard):
        """The fault of inject_bitflip_iters (or None) when inject_bitflip_target names the optimizer's state of the
        first matrix: "exp_avg" or "exp_avg_sq" (Adam's moments), "master" (the fp32 master of a half-precision
        weight; the weight itself in fp32). On rank inject_bitflip_rank, after an applied step: the next updates
        compute with it. With ZeRO-1 only the rank that owns the matrix's state holds it (elsewhere: a line, no
        flip). Once in time, as bitflip()."""
        target = self.faults_cfg.inject_bitflip_target
        if target not in STATE_TARGETS or not (
            guard.meets_fault(iteration, self.bitflip_ranges)
            and parallel.grid.rank == self.faults_cfg.inject_bitflip_rank
        ):
            return None

        @torch.no_grad()
        def flip():
            first = next(p for p in parallel.unwrap(self.model).parameters() if p.dim() == 2)
            main = getattr(self.optimizer, "main_param", lambda p: p)(first)
            held = main if target == "master" else self.optimizer.state.get(main, {}).get(target)
            if held is None:
                print(
                    f"spike guard: iteration {iteration}: rank {parallel.grid.rank} holds no {target} of the first "
                    "matrix (ZeRO-1: another DP rank owns it): no bit flipped",
                    flush=True,
                )
                return
            self.flip_bit(held.view(-1), iteration, target)

        return flip

    def flip_bit(self, flat, iteration, what):
        """Flip inject_bitflip_bit (-1: the top exponent bit) of inject_bitflip_element (-1: the largest in
        magnitude) of the float tensor flat, in place. Bits count from the least significant: in fp32, 0-22 the
        mantissa, 23-30 the exponent (23, 24 its lowest: x2 or /2, x4 or /4), 31 the sign."""
        faults_cfg = self.faults_cfg
        element = faults_cfg.inject_bitflip_element
        i = int(flat.abs().argmax()) if element < 0 else element % flat.numel()
        itype, bit = {
            torch.float32: (torch.int32, 30),
            torch.bfloat16: (torch.int16, 14),
            torch.float16: (torch.int16, 14),
        }[flat.dtype]
        if faults_cfg.inject_bitflip_bit >= 0:  # any bit (sign, exponent, mantissa) of its width
            bit = faults_cfg.inject_bitflip_bit % (8 * flat.element_size())
        flat.view(itype)[i] ^= 1 << bit
        print(
            f"spike guard: iteration {iteration}: injected a bit flip into {what} element {i} on rank "
            f"{parallel.grid.rank}: {float(flat[i]):.4g}",
            flush=True,
        )

    def lose_optimizer_state(self, iteration, guard):
        """The fault of inject_lost_optimizer_state_iter: before its step, every exp_avg and exp_avg_sq the optimizer
        holds (on every rank: a resume loses them everywhere) is zeroed, its step count kept, so bias correction does
        not make up for it and the first updates are ~(1-beta1)/sqrt(1-beta2) x LR per element. Once in time, as an
        LR spike: a rollback restores the moments and the iteration run again does not meet it."""
        at = self.faults_cfg.inject_lost_optimizer_state_iter
        if at is None or not guard.meets_fault(iteration, [(at, at)]):
            return
        zeroed = 0
        for state in self.optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key].zero_()
                    zeroed += state[key].numel()
        print(
            f"spike guard: iteration {iteration}: injected a lost optimizer state on rank {parallel.grid.rank}: "
            f"{zeroed} moment elements zeroed",
            flush=True,
        )

    # -- a block of repeated documents (added last: other faults' functions go above) ----------------------------

    def repeated_batches(self, number, first_sample, batch_size, seqlen, batches):
        """inject_repeat_iters: a block of repeated documents met in corpus order, the shape of BigScience's and
        OPT's data incidents (a shard of near-duplicates): an iteration of the block is given the samples of the
        block's iteration start + (n - start) % inject_repeat_period again, read from the data by their place (the
        same on every rank, replay and resume; the batch size constant over the block). The documents are those of
        the block's own places: a skip list that names them names the block."""
        for start, end in self.repeat_ranges:
            if start <= number <= end:
                source = start + (number - start) % self.faults_cfg.inject_repeat_period
                first = first_sample - (number - source) * batch_size
                return loader.micro_batches(
                    self.train_data,
                    first,
                    len(batches),
                    self.core.micro_batch_size,
                    seqlen,
                    batches[0][0].device,
                )
        return batches

    def overflow(self, iteration, model):
        """The fault of inject_overflow_iters: a hook on the first matrix's gradient (its handle,
        removed after the iteration, or None) that makes one element inf when the gradient is
        fp16, on every rank -- so every step of these iterations overflows whatever the loss
        scale, its replays too, and the fp32 replay (diagnosis.Fp32Step: fp32 weights and
        gradients) does not: an fp16 overflow burst, the gradients fitting in fp32's range."""
        if not schedule.in_ranges(iteration, self.overflow_ranges):
            return None
        first = next(p for p in parallel.unwrap(model).parameters() if p.dim() == 2)

        def overflow(grad):
            if grad.dtype != torch.float16:
                return grad
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad

        return first.register_hook(overflow)

    # -- faults that stay where they live: samples bad in the corpus, a device that stays bad -----

    def corpus_batches(self, first_sample, batches):
        """The batches with inject_bad_samples' samples made bad: a row whose consumed-sample index
        is in the ranges gets that sample's bad tokens (bad_sample), the same whichever iteration,
        pass or rank reads it."""
        if not self.bad_sample_ranges or not batches:
            return batches
        g = parallel.grid
        rows = batches[0][0].shape[0]
        index = loader.sample_indices(first_sample, len(batches), rows, g.dp_rank, g.dp_size)
        # host numpy: no device sync
        bad = sum((index >= a) & (index <= b) for a, b in self.bad_sample_ranges)
        if not bad.any():
            return batches
        out = [(x.clone(), y.clone()) for x, y in batches]
        for k, j in zip(*bad.nonzero()):
            x, y, sample = *out[k], int(index[k, j])
            tokens = self.bad_sample(sample, torch.cat([x[j, :1], y[j]]).cpu())
            x[j], y[j] = tokens[:-1].to(x.device, x.dtype), tokens[1:].to(y.device, y.dtype)
        return out

    def bad_sample(self, sample, tokens):
        """The bad tokens of consumed sample `sample` (its clean tokens: `tokens`, seqlen + 1 of
        them), from a generator seeded by (seed, sample): "random" -- random ids; "repeat" -- its
        commonest token over and over (tr8-104B's backslash-only samples); "ngram" -- an 8-gram
        repeated; "duplicate" -- the clean tokens of the range's sample start + (sample - start) %
        inject_duplicate_period (a block of near-duplicates)."""
        faults_cfg, length = self.faults_cfg, tokens.numel()
        gen = torch.Generator().manual_seed(self.seed * 1_000_037 + sample)
        kind = faults_cfg.inject_bad_samples_kind
        if kind == "random":
            return torch.randint(0, self.vocab_size, (length,), generator=gen)
        if kind == "repeat":
            return torch.mode(tokens).values.expand(length).clone()
        if kind == "ngram":
            gram = torch.randint(0, self.vocab_size, (8,), generator=gen)
            return gram.repeat(length // 8 + 1)[:length]
        start = next(a for a, b in self.bad_sample_ranges if a <= sample <= b)
        source = start + (sample - start) % faults_cfg.inject_duplicate_period
        return loader.load_tokens(self.train_data, source, 1, length - 1, 1, 0, 1)[0, 0]

    def bad_device(self, iteration):
        """inject_bad_device_iter: from the first pass through it on, a flip of the reduced gradient
        on inject_bitflip_rank at every step, whatever the iteration (a rollback's replays of
        earlier ones too)."""
        at = self.faults_cfg.inject_bad_device_iter
        self.device_bad = self.device_bad or (at is not None and iteration >= at)
        if not self.device_bad or parallel.grid.rank != self.faults_cfg.inject_bitflip_rank:
            return None

        @torch.no_grad()
        def flip(model):
            params = [p for p in parallel.unwrap(model).parameters() if p.dim() == 2]
            grad = parallel.main_grad(params[0]).view(-1)
            self.flip_bit(grad, iteration, "gradient (a bad device)")

        return flip


class NoTimeline:
    """The timeline of a run with no fault in time (no guard built: stability.REGISTRY builds it for
    each of them): no pass meets one. The faults that stay where they live need none."""

    def meets_fault(self, iteration, ranges):
        return False


# inject_bitflip_target's names of the optimizer's state
STATE_TARGETS = ("exp_avg", "exp_avg_sq", "master")
