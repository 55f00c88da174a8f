"""The run's plan: what each iteration does, as a function of the run's progress.

    schedule = Schedule(schedule_cfg, dp_size, seq_length, start)   # start: a resume's run state
    schedule.batch_size(consumed_samples)     the global batch: Megatron's ramp-up (lesson 12)
    schedule.seqlen(iteration)                its length: DeepSpeed's curriculum (lesson 13)
    schedule.skipped(iteration)               in skip_train_iteration_range: skipped (lesson 9)
    schedule.lr_at(iteration, state)          the schedule's learning rate
    schedule.done(state)                      train_iters, train_samples or train_tokens reached

The learning rate of an iteration is Megatron-DeepSpeed's AnnealingLR of the samples (or tokens) of
the updates applied so far, zero during the warm-up of an optimizer reset (lesson 8). The shape of its
decay is a pure function of the progress through the decay window, one entry of LR_SHAPES: a new shape
is one function and one entry there. What the stability layer does to the LR (the spike guard's
factor, fault injection) it applies itself, on top of lr_at's.

Everything here follows from the config and the run state (run_state.RunState), except AnnealingLR's
token count at the end of a sample warm-up, which the checkpoint keeps. Not here: the counters
(run_state.py), and what the run decides by itself: the spike guard's skips and LR factor.

The schedule's keys and their checks are ScheduleConfig and check() below (arguments.Config is made of
each owner's keys).
"""

import math
from dataclasses import dataclass, replace


@dataclass
class ScheduleConfig:
    # -- schedule: batch size, length of training, learning rate, curriculum --
    micro_batch_size: int = 8  # samples per forward/backward on each data-parallel rank
    # samples per iteration; None: micro_batch_size * data-parallel size
    global_batch_size: int | None = None
    # "start increment samples": Megatron's batch-size ramp-up
    rampup_batch_size: list[int] | None = None
    # stop after this many iterations (whichever of iters/samples/tokens comes first)
    train_iters: int | None = None
    train_samples: int | None = None  # stop after this many samples
    train_tokens: int | None = None  # stop after this many tokens
    lr: float = 6e-4  # peak learning rate, reached at the end of the warm-up
    min_lr: float = 0.0  # learning rate at the end of the decay
    # the decay's shape, one of schedule.LR_SHAPES: linear | cosine | constant | wsd
    lr_decay_style: str = "cosine"
    lr_warmup_samples: int = 0  # linear warm-up from 0 over this many samples
    # warm-up over tokens instead of samples (with a curriculum)
    lr_warmup_tokens: int | None = None
    # decay to min_lr over this many samples; None: the whole run
    lr_decay_samples: int | None = None
    lr_decay_tokens: int | None = None  # decay over tokens instead of samples (with a curriculum)
    # wsd: lr until the last this many samples of the decay, then anneal
    lr_wsd_decay_samples: int | None = None
    # wsd's anneal to min_lr: exponential | linear | cosine | minus_sqrt
    lr_wsd_decay_style: str = "exponential"
    # on resume, follow this config's LR schedule, not the checkpoint's
    override_lr_scheduler: bool = False
    curriculum_learning: bool = False  # sequence-length curriculum (DeepSpeed's fixed_linear)
    min_difficulty: int = 64  # first sequence length of the curriculum
    max_difficulty: int | None = None  # last sequence length of the curriculum; None: seq_length
    # iterations until the curriculum reaches max_difficulty
    total_curriculum_step: int | None = None
    difficulty_step: int = 8  # curriculum sequence lengths are multiples of this
    # resume: fresh optimizer, lr 0 for N iters ("auto": the optimizer's count; Adam's 5/(1-beta2))
    reset_optimizer_warmup_iters: int | str | None = None
    # discard the batches of iterations "13251-14000 ..."
    skip_train_iteration_range: list[str] | None = None

    # keys read only while a switch is on (sections.py); only a resume has a checkpoint's schedule to override
    SWITCHED = {
        "curriculum_learning": (
            "min_difficulty",
            "max_difficulty",
            "total_curriculum_step",
            "difficulty_step",
        ),
        "lr_decay_style=wsd": ("lr_wsd_decay_samples", "lr_wsd_decay_style"),
        "load|save": ("override_lr_scheduler",),
    }


# Pairs of keys that give one setting in two units, of which a config means one (Megatron's exclusive arguments): a
# key given on the command line replaces the config file's other one (arguments.load_config).
# The warm-up and the decay count samples or tokens, never both: check() refuses the two together.
EXCLUSIVE = (("lr_warmup_samples", "lr_warmup_tokens"), ("lr_decay_samples", "lr_decay_tokens"))
# The length of training in iterations or in samples and tokens (these two go together: a curriculum's token budget,
# lesson 13). check() refuses train_iters only with rampup_batch_size, which counts samples; without it, whichever
# length is reached first ends training.
EXCLUSIVE_LENGTHS = (("train_iters", "train_samples"), ("train_iters", "train_tokens"))


def _given(schedule_cfg, key):
    """Is `key` set, to something else than its default (lr_warmup_samples=0 and train_iters=None are not)?"""
    return getattr(schedule_cfg, key) != ScheduleConfig.__dataclass_fields__[key].default


# The config keys of the LR schedule: what a resume may change only with override_lr_scheduler (safety.py)
LR_KEYS = (
    "lr",
    "min_lr",
    "lr_decay_style",
    "lr_warmup_samples",
    "lr_warmup_tokens",
    "lr_decay_samples",
    "lr_decay_tokens",
    "lr_wsd_decay_samples",
    "lr_wsd_decay_style",
)


def check(schedule_cfg, dp_size=1, load=None, seq_length=None):
    """Raise ValueError with the fix for a schedule that cannot run. dp_size: the data-parallel size
    of the run (it divides the global batch); load: checkpointing's load directory (an optimizer
    reset needs one); seq_length: the model's, given: the whole Schedule is made once, so that what
    only it checks (the ramp-up's batches, the curriculum's lengths, the LR's warm-up against its
    decay) is refused before the run starts its processes and its save directory."""
    keys = schedule_cfg
    _check_sizes(keys, dp_size)
    _check_lr(keys)
    _check_restart(keys, load)
    steps = keys.total_curriculum_step
    _need(
        not keys.curriculum_learning or (steps is not None and steps > 0),
        "curriculum_learning needs total_curriculum_step (about train_tokens / global_batch / seq_length / 2)",
    )
    if seq_length is not None:  # with what arguments.derive fills in
        batch = keys.global_batch_size or keys.micro_batch_size * dp_size
        longest = keys.max_difficulty or seq_length
        Schedule(
            replace(keys, global_batch_size=batch, max_difficulty=longest), dp_size, seq_length
        )


def _need(ok, message):
    """Raise ValueError(message) unless ok."""
    if not ok:
        raise ValueError(message)


def _check_sizes(keys, dp_size):
    """Positive sizes and lengths, non-negative rates, a global batch that splits, one unit each."""
    for key in (
        "micro_batch_size",
        "global_batch_size",
        "train_iters",
        "train_samples",
        "train_tokens",
    ):
        value = getattr(keys, key)
        _need(value is None or value > 0, f"{key}={value} must be positive")
    for key in ("lr_decay_samples", "lr_decay_tokens"):
        value = getattr(keys, key)
        # lr_decay_samples=0 was read as unset: a decay over the whole run
        _need(
            value is None or value > 0,
            f"{key}={value} must be positive, or unset for the run's length",
        )
    for key in ("lr", "min_lr", "lr_warmup_samples"):
        _need(getattr(keys, key) >= 0, f"{key}={getattr(keys, key)} must not be negative")
    gbs, mbs, dp = keys.global_batch_size, keys.micro_batch_size, dp_size
    _need(
        gbs is None or gbs % (mbs * dp) == 0,
        f"global_batch_size ({gbs}) must be divisible by micro_batch_size ({mbs})"
        f" x data-parallel size ({dp}); change one of them",
    )
    _need(
        any(x is not None for x in (keys.train_iters, keys.train_samples, keys.train_tokens)),
        "set the length of training: train_iters, train_samples or train_tokens",
    )
    _need(
        keys.rampup_batch_size is None or keys.train_iters is None,
        "rampup_batch_size counts samples: set train_samples (or train_tokens) instead of train_iters",
    )
    for a, b in EXCLUSIVE:
        _need(
            not (_given(keys, a) and _given(keys, b)),
            f"both {a} and {b} are set; set only one of them",
        )
    _need(
        keys.rampup_batch_size is None or len(keys.rampup_batch_size) == 3,
        f"rampup_batch_size must be 'start increment samples', got {keys.rampup_batch_size}",
    )
    batch = gbs or mbs * dp  # arguments.derive's global batch
    unset = "" if gbs else " (unset: micro_batch_size x data-parallel size)"
    start = keys.rampup_batch_size[0] if keys.rampup_batch_size else batch
    _need(
        keys.rampup_batch_size is None or start != batch,
        f"rampup_batch_size starts at {start} = global_batch_size{unset}: there is nothing to ramp; set "
        "global_batch_size to the batch the ramp-up ends at, or drop rampup_batch_size",
    )
    # Megatron's last batch that would go past train_samples is not run: below the first batch, no iteration is
    _need(
        keys.train_samples is None or keys.train_samples >= start,
        f"train_samples={keys.train_samples} is less than the first global batch ({start}): no iteration would "
        "run; train_samples counts samples (iterations x global_batch_size)",
    )


def _check_lr(keys):
    """The LR schedule's shape, min_lr under lr, and WSD's anneal counted in samples."""
    _need(
        keys.lr_decay_style in LR_SHAPES,
        f"lr_decay_style={keys.lr_decay_style!r} is not "
        f"{' or '.join(', '.join(LR_SHAPES).rsplit(', ', 1))}",
    )
    _need(keys.min_lr <= keys.lr, f"min_lr ({keys.min_lr}) is larger than lr ({keys.lr})")
    _need(
        keys.lr_decay_style != "wsd" or (keys.lr_wsd_decay_samples or 0) > 0,
        "lr_decay_style='wsd' needs lr_wsd_decay_samples (the samples of its final anneal, e.g. a tenth of the run)",
    )
    _need(
        keys.lr_decay_style != "wsd" or keys.lr_decay_tokens is None,
        "lr_decay_style='wsd' counts its anneal in samples (lr_wsd_decay_samples): use lr_decay_samples, not "
        "lr_decay_tokens",
    )
    _need(
        keys.lr_wsd_decay_style in WSD_ANNEALS,
        f"lr_wsd_decay_style={keys.lr_wsd_decay_style!r} is not one of {', '.join(WSD_ANNEALS)}",
    )


def _check_restart(keys, load):
    """A restart after a divergence: iterations skipped, the optimizer reset's warm-up."""
    parse_iteration_ranges(keys.skip_train_iteration_range, "skip_train_iteration_range")
    warmup = keys.reset_optimizer_warmup_iters
    _need(
        warmup in (None, "auto") or isinstance(warmup, int),
        "reset_optimizer_warmup_iters must be a number of iterations or 'auto'",
    )
    # a count: -3 would read as "lr=0 for -3 iterations", and 0 resets nothing
    # (optim.reset_warmup_iters, which also turns "auto" into the optimizer's own count)
    _need(
        not isinstance(warmup, int) or warmup > 0,
        f"reset_optimizer_warmup_iters={warmup} must be a positive number of lr=0 iterations "
        "after the optimizer reset (or 'auto': the optimizer's own count, Adam's "
        "5 / (1 - adam_beta2)); unset it for none",
    )
    _need(
        warmup is None or load is not None,
        "reset_optimizer_warmup_iters resets the optimizer of a loaded checkpoint: set load too",
    )


class Schedule:
    """Batch size, sequence length, skipped iterations, learning rate and the end of training."""

    def __init__(self, schedule_cfg, dp_size, seq_length, start=None):
        """schedule_cfg: a ScheduleConfig; seq_length: the model's (the length, no curriculum); start: the
        checkpoint's run state a resume goes on from (a dict: iteration, consumed_samples, consumed_tokens), or
        None. The totals are the run's at its end, from where it is: a resume that changed the global batch or
        seq_length ends elsewhere than this config from iteration 0 would (the data's index is built for them)."""
        self.schedule_cfg, self.seq_length, keys = schedule_cfg, seq_length, schedule_cfg
        self.rampup = RampupBatchSize(
            keys.rampup_batch_size, keys.global_batch_size, keys.micro_batch_size, dp_size
        )
        if keys.curriculum_learning:
            check_curriculum(
                keys.min_difficulty, keys.max_difficulty, seq_length, keys.difficulty_step
            )
        self.skip_ranges = parse_iteration_ranges(keys.skip_train_iteration_range)
        self.total_iters, self.total_samples, self.total_tokens = self._simulate(start or {})
        unset = keys.lr_decay_samples is None
        try:
            self.lr_schedule = AnnealingLR(
                keys.lr,
                keys.min_lr,
                keys.lr_decay_style,
                warmup_samples=keys.lr_warmup_samples,
                decay_samples=self.total_samples if unset else keys.lr_decay_samples,
                warmup_tokens=keys.lr_warmup_tokens,
                decay_tokens=keys.lr_decay_tokens,
                wsd_decay_samples=keys.lr_wsd_decay_samples,
                wsd_decay_style=keys.lr_wsd_decay_style,
            )
        except ValueError as e:
            # the message names a key the config does not set: say where its value came from
            if not (unset and keys.lr_decay_tokens is None and "lr_decay_samples (" in str(e)):
                raise
            raise ValueError(
                f"{e} (lr_decay_samples is unset: the decay runs over the run's {self.total_samples:,} samples; "
                "lengthen the run, shorten the warm-up or set lr_decay_samples)"
            ) from None

    def batch_size(self, consumed_samples):
        return self.rampup(consumed_samples)

    def seqlen(self, iteration):
        keys = self.schedule_cfg
        if not keys.curriculum_learning:
            return self.seq_length
        return curriculum_seqlen(
            iteration,
            keys.min_difficulty,
            keys.max_difficulty,
            keys.total_curriculum_step,
            keys.difficulty_step,
        )

    def skipped(self, iteration):
        return in_ranges(iteration, self.skip_ranges)

    def lr_at(self, iteration, state):
        """The learning rate of `iteration`, from the run state before it. Its scheduler_samples and
        scheduler_tokens count the applied updates: Megatron's schedule stands still on skipped
        steps (lesson 5)."""
        reset = state.optimizer_reset
        if reset is not None and reset["updates"] < reset["warmup_iters"]:
            return 0.0  # lesson 8: the fresh moments warm up (applied updates) while the weights stay put
        return self.lr_schedule.get_lr(state.scheduler_samples, state.scheduler_tokens)

    def done(self, state):
        return self._done(state.iteration, state.consumed_samples, state.consumed_tokens)

    def next_key(self, key):
        """The (iteration, first sample, batch size, seqlen) of the next iteration that trains after
        `key`'s (skipped ones draw their samples unused); None past the end. What loader.Prefetcher
        loads ahead."""
        iteration, samples = key[0] + 1, key[1] + key[2]
        while self.skipped(iteration):
            iteration, samples = iteration + 1, samples + self.batch_size(samples)
        if iteration > self.total_iters:
            return None
        return iteration, samples, self.batch_size(samples), self.seqlen(iteration)

    def describe(self):
        """The LR schedule in words, and a warning line for a warm-up the run ends inside (Megatron runs it: a
        short trial of a large config's first iterations does; a run that means to train never reaches lr) and
        for each skip_train_iteration_range that starts after the run's end."""
        lines, lr, longer = [self.lr_schedule.describe()], self.lr_schedule, None
        if lr.warmup_tokens is not None and lr.warmup_tokens > self.total_tokens:
            longer = f"lr_warmup_tokens={lr.warmup_tokens:,} is longer than the run ({self.total_tokens:,} tokens)"
        elif lr.warmup_tokens is None and lr.warmup_samples > self.total_samples:
            longer = f"lr_warmup_samples={lr.warmup_samples:,} is longer than the run ({self.total_samples:,} samples)"
        if longer:
            lines.append(
                f"warning: the warm-up {longer}: the learning rate never reaches lr={lr.max_lr}"
            )
        # a range of a longer run's config, kept: it skips nothing here
        for text in self.schedule_cfg.skip_train_iteration_range or []:
            ((start, _),) = parse_iteration_ranges([text])
            if start > self.total_iters:
                lines.append(
                    f"warning: skip_train_iteration_range {text} starts after the run's last iteration "
                    f"{self.total_iters}: nothing of it is skipped"
                )
        return "\n".join(lines)

    def _done(self, iteration, samples, tokens):
        """Megatron's update_train_iters: a last batch that would go past train_samples is not run
        (tr8b-104B's 300M samples are "159576" iterations, not 159577)."""
        keys = self.schedule_cfg
        return (
            (keys.train_iters is not None and iteration >= keys.train_iters)
            or (
                keys.train_samples is not None
                and samples + self.batch_size(samples) > keys.train_samples
            )
            or (keys.train_tokens is not None and tokens >= keys.train_tokens)
        )

    def _simulate(self, start):
        it, samples, tokens = (
            start.get(k, 0) for k in ("iteration", "consumed_samples", "consumed_tokens")
        )
        while not self._done(it, samples, tokens):
            b = self.batch_size(samples)
            it += 1
            samples, tokens = samples + b, tokens + b * self.seqlen(it)
        return it, samples, tokens


# -----------------------------------------------------------------------------
# Iteration ranges: skip_train_iteration_range, the spike guard's skip ranges, fault injection


def parse_iteration_ranges(
    ranges,
    key="skip_train_iteration_range",
    lowest=1,
    unit="iterations are 1-based and inclusive, e.g. 13251-14000",
):
    """["13251-14000", "16652-18500"] -> [(13251, 14000), (16652, 18500)]: inclusive, 1-based
    (Megatron-DeepSpeed's format); lowest and unit: another count's (a fault's sample indices)."""
    out = []
    for r in ranges or []:
        start, dash, end = str(r).partition("-")
        try:
            start, end = int(start.replace("_", "")), int(end.replace("_", "")) if dash else None
        except ValueError:
            end = None
        if end is None or not lowest <= start <= end:
            raise ValueError(
                f"{key} entry {r!r} is not 'START-END' with {lowest} <= START <= END ({unit})"
            )
        out.append((start, end))
    return sorted(out)


def in_ranges(iteration, ranges):
    return any(start <= iteration <= end for start, end in ranges)


# -----------------------------------------------------------------------------
# The optimizer reset's lr=0 warm-up (lesson 8): how long, by the optimizer's entry (optim.py)


def moment_warmup_iters(beta2):
    """The lr=0 iterations an optimizer's moment averaging at decay beta2 (Adam's second moment,
    Lion's momentum) needs after a reset zeroed it: five of its time constants 1 / (1 - beta2),
    which leave e^-5 of the zero start (100 at 0.95, the tr8b-104B reset's N)."""
    return math.ceil(5 / (1 - beta2))


# -----------------------------------------------------------------------------
# Batch-size ramp-up (Megatron's --rampup-batch-size "start incr samples"). Small batches early are cheap
# steps while the loss falls fast; lesson 12 is the flip side: with pipeline parallelism a start batch too
# small to fill the pipeline runs at a fraction of the throughput: main-2 tried "384 16 9_765_625", the final
# run started at 192.


class RampupBatchSize:
    def __init__(
        self, rampup, global_batch_size: int, micro_batch_size: int, data_parallel_size: int
    ):
        self.global_batch_size = global_batch_size
        self.micro_batch_times_dp = micro_batch_size * data_parallel_size
        if rampup is None:
            self.start, self.increment, self.samples, self.increments = global_batch_size, 0, 0, 0
        else:
            try:
                parts = rampup.split() if isinstance(rampup, str) else list(rampup)
                self.start, self.increment, self.samples = (
                    int(str(p).replace("_", "")) for p in parts
                )
            except ValueError:
                raise ValueError(
                    f"rampup_batch_size {rampup!r} must be three integers 'start increment samples', "
                    "e.g. '16 16 9_765_625'"
                ) from None
            if (
                self.start <= 0
                or self.increment <= 0
                or self.samples <= 0
                or self.start > global_batch_size
            ):
                raise ValueError(
                    f"rampup_batch_size {rampup!r}: need 0 < start <= global_batch_size "
                    f"({global_batch_size}), increment > 0 and samples > 0"
                )
            diff = global_batch_size - self.start
            if diff % self.increment:
                raise ValueError(
                    f"rampup_batch_size {rampup!r}: global_batch_size - start = {diff} is not a multiple "
                    f"of the increment {self.increment}"
                )
            self.increments = diff // self.increment
        for batch in range(self.start, global_batch_size + 1, self.increment or 1):
            if batch % self.micro_batch_times_dp:
                raise ValueError(
                    f"batch size {batch} (reached by rampup_batch_size {rampup!r} / global_batch_size "
                    f"{global_batch_size}) is not divisible by micro_batch_size * data_parallel_size = "
                    f"{micro_batch_size} * {data_parallel_size}; change the ramp-up or the batch sizes"
                )

    def __call__(self, consumed_samples: int) -> int:
        """Global batch size once `consumed_samples` samples have been consumed."""
        if self.increments == 0 or consumed_samples > self.samples:
            return self.global_batch_size
        # start + floor(c / (samples / increments)) * incr, in integers: Megatron's float division can land a hair
        # below an exact boundary (e.g. c == samples) and return the previous batch size.
        return self.start + (consumed_samples * self.increments // self.samples) * self.increment

    def num_micro_batches(self, consumed_samples: int) -> int:
        """Gradient-accumulation steps per iteration on each data-parallel rank."""
        return self(consumed_samples) // self.micro_batch_times_dp


# -----------------------------------------------------------------------------
# Sequence-length curriculum (DeepSpeed's fixed_linear, lesson 13): train on the first d tokens of each
# sample, d growing linearly from min_difficulty to max_difficulty = seq_length over total_curriculum_step steps.


def check_curriculum(
    min_difficulty: int,
    max_difficulty: int,
    seq_length: int,
    difficulty_step: int = 8,
    total_curriculum_step: int | None = None,
) -> None:
    """Raise one ValueError listing every violated constraint (total_curriculum_step is checked when given)."""
    problems = []
    if difficulty_step <= 0 or difficulty_step % 8:
        problems.append(
            f"difficulty_step {difficulty_step} must be a positive multiple of 8 (tensor cores; "
            "lesson 13)"
        )
    elif min_difficulty <= 0 or min_difficulty % difficulty_step:
        problems.append(
            f"min_difficulty {min_difficulty} must be a positive multiple of difficulty_step "
            f"{difficulty_step} (lesson 13)"
        )
    if max_difficulty != seq_length:
        problems.append(
            f"max_difficulty {max_difficulty} must equal seq_length {seq_length} (lesson 13)"
        )
    if min_difficulty > max_difficulty:
        problems.append(
            f"min_difficulty {min_difficulty} must not exceed max_difficulty {max_difficulty}"
        )
    if total_curriculum_step is not None and total_curriculum_step <= 0:
        problems.append(
            f"total_curriculum_step {total_curriculum_step} must be positive (lesson 13 recommends "
            "~train_tokens / global_batch / seq_length / 2)"
        )
    if problems:
        raise ValueError("curriculum learning config: " + "; ".join(problems))


def curriculum_seqlen(
    step: int,
    min_difficulty: int,
    max_difficulty: int,
    total_curriculum_step: int,
    difficulty_step: int = 8,
) -> int:
    """Sequence length for 1-based iteration `step` (Megatron-DeepSpeed calls update_difficulty(iteration + 1)).
    Same float expression as DeepSpeed, so the lengths switch at exactly the same iterations."""
    d = math.floor(
        float(step) / total_curriculum_step * (max_difficulty - min_difficulty) + min_difficulty
    )
    d -= d % difficulty_step
    return min(d, max_difficulty)


# -----------------------------------------------------------------------------
# The shapes of the learning-rate decay (lingua's lr_linear / lr_cosine / lr_wsd): pure functions of the progress
# through the decay window, 0 at its start and 1 at its end, to the coefficient of (lr - min_lr) above min_lr.
# AnnealingLR does Megatron's sample and token bookkeeping and asks LR_SHAPES[lr_decay_style] for the coefficient.


def lr_linear(progress):
    return 1.0 - progress


def lr_cosine(progress):
    return 0.5 * (math.cos(math.pi * progress) + 1.0)


def lr_constant(progress):
    return 1.0


def lr_exponential(progress):
    return 2.0 * math.pow(0.5, progress) - 1.0


def lr_minus_sqrt(progress):
    return 1.0 - math.sqrt(progress)


# Megatron's --lr-wsd-decay-style: the shape of WSD's final anneal, over the anneal's own progress
WSD_ANNEALS = {
    "exponential": lr_exponential,
    "linear": lr_linear,
    "cosine": lr_cosine,
    "minus_sqrt": lr_minus_sqrt,
}


def lr_wsd(progress, decay_fraction, anneal="exponential"):
    """Warm-up-stable-decay (MiniCPM; Megatron's WSD): the full LR until the last decay_fraction of the decay
    window, then an anneal to min_lr shaped by WSD_ANNEALS[anneal]. A run can branch off an anneal from any
    checkpoint of the stable phase."""
    stable = 1.0 - decay_fraction
    if progress <= stable:
        return 1.0
    return WSD_ANNEALS[anneal](min(1.0, (progress - stable) / decay_fraction))


LR_SHAPES = {"linear": lr_linear, "cosine": lr_cosine, "constant": lr_constant, "wsd": lr_wsd}


def build_lr_fn(style, **options):
    """The coefficient of a decay style as a function of progress alone; options: the shape's own parameters
    (wsd: decay_fraction and anneal)."""
    shape = LR_SHAPES[style]
    return lambda progress: shape(progress, **options)


# -----------------------------------------------------------------------------
# The learning-rate schedule


# the fix of the rules on several of the LR schedule's keys at once (AnnealingLR._validate)
_LR_FIX = "check lr, min_lr, lr_decay_style, lr_warmup_samples/tokens and lr_decay_samples/tokens"


class AnnealingLR:
    """Megatron-DeepSpeed's AnnealingLR (lesson 23) as a function of consumed samples and
    tokens. Megatron's "steps" are consumed samples.

    - warm-up: by samples (lr = max_lr * samples / warmup_samples while samples <= warmup_samples) or,
      when warmup_tokens is set, by tokens;
    - decay by samples, or by tokens when decay_tokens is set (used with curriculum learning, where a
      sample's length varies). Token decay runs from the token count at the end of warm-up, which is
      only known once it happens, so it is remembered and saved in state_dict();
    - "constant": max_lr after warm-up; the other shapes: min_lr + coeff * (max_lr - min_lr), coeff =
      LR_SHAPES[decay_style](progress through the decay); past the decay end: min_lr;
    - "wsd": max_lr until the last wsd_decay_samples before decay_samples, then an anneal to min_lr
      (Megatron's --lr-wsd-decay-samples and --lr-wsd-decay-style).

    Megatron records the warm-up-end token count only at a call with samples == warmup exactly, and
    keeps 0 when the batch sizes never land on it (the lr then drops at the end of warm-up). We record
    it at the first call with samples >= warmup, which is the same when they do land on it.

    Note: Megatron and DeepSpeed advance the schedule only on applied (not skipped) iterations, so the
    samples a caller passes should exclude iterations skipped for an fp16 overflow to reproduce their
    logs (lesson 5; the tr8b-104B log at iteration 6502: 5.997E-05 at 216960 consumed samples fits a
    731-738 sample lag).
    """

    def __init__(
        self,
        max_lr,
        min_lr,
        decay_style,
        warmup_samples=0,
        decay_samples=None,
        warmup_tokens=None,
        decay_tokens=None,
        wsd_decay_samples=None,
        wsd_decay_style="exponential",
    ):
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.decay_style = decay_style
        self.warmup_samples = int(warmup_samples or 0)
        self.decay_samples = None if decay_samples is None else int(decay_samples)
        self.warmup_tokens = None if warmup_tokens is None else int(warmup_tokens)
        self.decay_tokens = None if decay_tokens is None else int(decay_tokens)
        self.wsd_decay_samples = None if wsd_decay_samples is None else int(wsd_decay_samples)
        self.wsd_decay_style = wsd_decay_style
        self._validate()
        options = {}
        if decay_style == "wsd":
            options = {
                "decay_fraction": self.wsd_decay_samples
                / (self.decay_samples - self.warmup_samples),
                "anneal": wsd_decay_style,
            }
        self.coefficient = build_lr_fn(decay_style, **options)

        # token count at the end of warm-up: fixed by the config for a token warm-up or no warm-up,
        # remembered when it happens for a sample warm-up (None until then)
        self.warmup_end_tokens = self._configured_warmup_end_tokens()

    def _configured_warmup_end_tokens(self):
        if self.warmup_tokens is not None:
            return self.warmup_tokens
        return 0 if self.warmup_samples == 0 else None

    def _validate(self):
        """Raise ValueError with the fix for a schedule that cannot run: rates, warm-up, decay."""
        self._validate_rates()
        self._validate_warmup()
        self._validate_decay()
        if self.decay_style == "wsd":
            self._validate_wsd()

    def _validate_rates(self):
        """A known decay shape, learning rates not negative, min_lr not above lr."""
        if self.decay_style not in LR_SHAPES:
            raise ValueError(
                f"unknown lr_decay_style {self.decay_style!r}; use one of {', '.join(LR_SHAPES)}"
            )
        if self.min_lr < 0.0 or self.max_lr < 0.0:
            raise ValueError(
                f"learning rates must be >= 0 (lr {self.max_lr}, min_lr {self.min_lr}); {_LR_FIX}"
            )
        if self.min_lr > self.max_lr:
            raise ValueError(
                f"min_lr {self.min_lr} is larger than lr {self.max_lr}; lower min_lr or raise lr"
            )

    def _validate_warmup(self):
        """A warm-up in samples or in tokens, not negative; a token warm-up needs a token decay."""
        if self.warmup_samples < 0:
            raise ValueError(f"lr_warmup_samples must be >= 0, got {self.warmup_samples}")
        if self.warmup_tokens is not None:
            if self.warmup_samples > 0:
                raise ValueError(
                    "both lr_warmup_samples and lr_warmup_tokens are set; set only one of them"
                )
            if self.warmup_tokens < 0:
                raise ValueError(f"lr_warmup_tokens must be >= 0, got {self.warmup_tokens}")
            if self.decay_tokens is None and self.decay_style != "constant":
                raise ValueError(
                    "lr_warmup_tokens needs lr_decay_tokens (a token warm-up and a sample decay "
                    "have no common origin); set lr_decay_tokens or use lr_warmup_samples"
                )

    def _validate_decay(self):
        """A decay length (samples or tokens, unless constant) that ends after the warm-up."""
        if self.decay_tokens is not None:
            warmup = self.warmup_tokens or 0
            if self.decay_tokens <= warmup:
                raise ValueError(
                    f"lr_decay_tokens ({self.decay_tokens}) must be larger than the warm-up "
                    f"({warmup} tokens); {_LR_FIX}"
                )
        elif self.decay_style != "constant" and self.decay_samples is None:
            raise ValueError(
                f"lr_decay_style {self.decay_style!r} needs lr_decay_samples (or lr_decay_tokens)"
            )
        if self.decay_samples is not None and self.decay_samples <= self.warmup_samples:
            raise ValueError(
                f"lr_decay_samples ({self.decay_samples}) must be larger than lr_warmup_samples "
                f"({self.warmup_samples}); {_LR_FIX}"
            )

    def _validate_wsd(self):
        """WSD's anneal: a length in samples that fits in the decay window, a known shape."""
        window = None if self.decay_samples is None else self.decay_samples - self.warmup_samples
        if (
            self.decay_tokens is not None
            or not self.wsd_decay_samples
            or not 0 < self.wsd_decay_samples <= window
        ):
            raise ValueError(
                "lr_decay_style 'wsd' needs 0 < "
                f"lr_wsd_decay_samples ({self.wsd_decay_samples}) <= "
                f"lr_decay_samples - lr_warmup_samples ({window}), counted in samples; {_LR_FIX}"
            )
        if self.wsd_decay_style not in WSD_ANNEALS:
            raise ValueError(
                f"unknown lr_wsd_decay_style {self.wsd_decay_style!r}; use one of "
                f"{', '.join(WSD_ANNEALS)}"
            )

    def get_lr(self, consumed_samples: int, consumed_tokens: int) -> float:
        if self.warmup_tokens is None and self.warmup_samples > 0:
            # remember the token count where the sample warm-up ends; while it has not ended nothing is
            # remembered (so a count restored from a checkpoint with another warm-up cannot stick)
            if consumed_samples <= self.warmup_samples:
                self.warmup_end_tokens = None
            if self.warmup_end_tokens is None and consumed_samples >= self.warmup_samples:
                self.warmup_end_tokens = consumed_tokens

        # linear warm-up
        if self.warmup_tokens is not None:
            if self.warmup_tokens > 0 and consumed_tokens <= self.warmup_tokens:
                return self.max_lr * consumed_tokens / self.warmup_tokens
        elif self.warmup_samples > 0 and consumed_samples <= self.warmup_samples:
            return self.max_lr * consumed_samples / self.warmup_samples

        if self.decay_style == "constant":
            return self.max_lr

        if self.decay_tokens is None:
            if consumed_samples > self.decay_samples:
                return self.min_lr
            ratio = (consumed_samples - self.warmup_samples) / (
                self.decay_samples - self.warmup_samples
            )
        else:
            if consumed_tokens >= self.decay_tokens:  # ratio 1 gives min_lr too; >= avoids 0/0 when
                return self.min_lr  # the warm-up ended at or past decay_tokens
            start = self.warmup_end_tokens
            ratio = (consumed_tokens - start) / (self.decay_tokens - start)
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(
                f"lr decay ratio {ratio} outside [0, 1] at {consumed_samples} samples / "
                f"{consumed_tokens} tokens (warm-up ended at {self.warmup_end_tokens} tokens); "
                f"the consumed counters went backwards, check the checkpoint"
            )

        return self.min_lr + self.coefficient(ratio) * (self.max_lr - self.min_lr)

    def describe(self) -> str:
        if self.warmup_tokens is not None:
            warmup = f"warm-up {self.warmup_tokens} tokens"
        else:
            warmup = f"warm-up {self.warmup_samples} samples"
        if self.decay_style == "constant":
            decay = "then constant"
        elif self.decay_style == "wsd":
            decay = (
                f"constant, then a {self.wsd_decay_style} anneal over the last {self.wsd_decay_samples} of "
                f"{self.decay_samples} samples"
            )
        elif self.decay_tokens is not None:
            decay = f"{self.decay_style} decay to {self.decay_tokens} tokens"
        else:
            decay = f"{self.decay_style} decay to {self.decay_samples} samples"
        return f"lr schedule: max_lr {self.max_lr}, min_lr {self.min_lr}, {warmup}, {decay}"

    # the quantities a resume must agree on, with the names Megatron prints
    _CHECKED = (
        ("max_lr", "learning rate"),
        ("min_lr", "minimum learning rate"),
        ("warmup_samples", "warm-up samples"),
        ("warmup_tokens", "warm-up tokens"),
        ("decay_samples", "decay samples"),
        ("decay_tokens", "decay tokens"),
        ("decay_style", "decay style"),
    )

    # wsd's own: checked only where either side is wsd, so that the checkpoints of the other shapes stay as they were
    _CHECKED_WSD = (
        ("wsd_decay_samples", "wsd decay samples"),
        ("wsd_decay_style", "wsd decay style"),
    )

    def _checked(self, sd=None):
        wsd = self.decay_style == "wsd" or (sd is not None and sd.get("decay_style") == "wsd")
        return self._CHECKED + (self._CHECKED_WSD if wsd else ())

    def state_dict(self) -> dict:
        sd = {key: getattr(self, key) for key, _ in self._checked()}
        sd["warmup_end_tokens"] = self.warmup_end_tokens
        return sd

    def load_state_dict(self, sd: dict, override: bool) -> None:
        """Without override the checkpoint's schedule must equal the config's (lesson 10: changing min_lr
        on resume was refused with an assertion). With override the config's hyper-parameters win and
        the lr follows them from the current consumed samples/tokens.

        The remembered warm-up-end token count is restored for a sample warm-up. When an override
        changed that warm-up: if the new warm-up has not ended yet, get_lr() forgets the restored count
        and records the true one when it ends; if it ended in the past, its token count was never seen
        and the checkpoint's count (the end of the old warm-up) is kept as the best estimate. For a
        token warm-up or none, the config fixes it (warmup_tokens, or 0)."""
        mismatches = [
            f"class input value {getattr(self, key)} and checkpoint value {sd.get(key)} for {name} do not match"
            for key, name in self._checked(sd)
            if getattr(self, key) != sd.get(key)
        ]
        if mismatches and not override:
            raise ValueError(
                "AnnealingLR: " + "; ".join(mismatches) + "; to use the config's schedule from "
                "the current consumed samples/tokens, set override_lr_scheduler "
                "(--override-lr-scheduler)"
            )
        self.warmup_end_tokens = self._configured_warmup_end_tokens()
        if self.warmup_end_tokens is None:
            self.warmup_end_tokens = sd.get("warmup_end_tokens")
