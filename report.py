"""What a run tells: Megatron's log line, the validation block, metrics.jsonl, TensorBoard, wandb.

    report = Report(log_cfg, schedule, model, save)   # writers on the last rank, which has the loss
    report.step(step, lr)                   # a trained iteration's numbers, into the interval
    report.log(iteration, state, batch_size, seqlen, loss_scale)   # every log_interval iterations

The log line is Megatron-DeepSpeed's, field for field and width for width, so the chronicles' logs
and ours parse alike. A new field is one entry in Report.log's `fields`; it reaches metrics.jsonl
under its log name. Scalars go to TensorBoard against iterations, consumed samples and consumed
tokens (a directory per axis), and to wandb. A resume or a rollback starts a new timeline
(Report.new_timeline); read_metrics reads metrics.jsonl's last one. Between two log lines the
interval sums the lm loss, the skipped and NaN iterations and the time.

Nothing here decides anything: the numbers come from train.py and from the stability layer (its spike guard's
decisions, its telemetry), which records them through `scalars` and `record`.
"""

import json
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import files
import parallel

# Nominal dense bf16 tensor-core TFLOP/s (no sparsity) and HBM GB/s by SKU, from NVIDIA's
# datasheets: the peak the log line's MFU (and bench.py's) divides by. The first name contained in
# torch.cuda.get_device_name wins: the PCIe and NVL parts come before the SXM one of their name (an
# H100 PCIe's MFU against the SXM's 989 would read 24% low).
GPU_PEAKS = (
    ("H100 PCIe", 756, 2000),
    ("H100 NVL", 835, 3900),
    ("H200", 989, 4800),
    ("H100", 989, 3350),
    ("A100", 312, 2039),
)


def gpu_peaks(name):
    """(bf16 TFLOP/s, GB/s) of the GPU whose torch.cuda.get_device_name is `name`, or None for one
    not listed."""
    return next(((tflops, gbs) for key, tflops, gbs in GPU_PEAKS if key in name), None)


def peak_flops(device):
    """The device's nominal bf16 FLOP/s from GPU_PEAKS, or None: a CPU (its peak depends on the
    threads given, which bench.py measures instead) or a GPU not listed. The log line's MFU says n/a
    then."""
    if device.type != "cuda":
        return None
    peaks = gpu_peaks(torch.cuda.get_device_name(device))
    return peaks[0] * 1e12 if peaks else None


@dataclass
class LoggingConfig:
    # -- logging: evaluation, TensorBoard, wandb, samples --
    log_interval: int = 100  # print the log line every this many iterations
    eval_interval: int = 1000  # validation loss every this many iterations (and at the end)
    eval_iters: int = 100  # global batches per validation
    eval_only: bool = False  # load the checkpoint, print the validation loss and a sample, exit
    tensorboard_dir: str | None = None  # TensorBoard events; None: <save>/tensorboard when saving
    wandb_project: str | None = None  # log to this wandb project too (files under <save>/wandb)
    wandb_mode: str = "offline"  # offline | online | disabled (WANDB_MODE overrides it)
    # at the end, print a sample of this many tokens generated from sample_prompt
    sample_tokens: int = 0
    sample_prompt: str = "ROMEO:\n"  # the prompt of that sample ("": from a document's start)
    # "A-B": a torch.profiler trace of iterations A to B in <save>/profile
    profile_steps: str | None = None

    # keys read only while a switch is on (sections.py)
    SWITCHED = {"wandb_project": ("wandb_mode",), "sample_tokens": ("sample_prompt",)}


def check(log_cfg):
    """Raise ValueError with the fix for logging keys (a LoggingConfig) that cannot work."""
    for key in ("eval_iters", "sample_tokens"):
        if getattr(log_cfg, key) < 0:
            raise ValueError(f"{key}={getattr(log_cfg, key)} must not be negative")
    if not (log_cfg.log_interval > 0 and log_cfg.eval_interval > 0):
        raise ValueError("log_interval and eval_interval must be positive")
    # training.evaluate_only's refusal, before the build
    if log_cfg.eval_only and log_cfg.eval_iters == 0:
        raise ValueError(
            "eval_only: no validation data (eval_iters 0): set eval_iters to the global batches to evaluate"
        )
    if log_cfg.profile_steps is not None:
        profile_range(log_cfg.profile_steps)  # raises
    # else wandb's own refusal, a page of pydantic naming no key, after the model's build
    if log_cfg.wandb_project and log_cfg.wandb_mode not in ("offline", "online", "disabled"):
        raise ValueError(
            f"wandb_mode={log_cfg.wandb_mode!r} is not offline, online or disabled (offline: files to "
            "`wandb sync` later, as a cluster without internet needs)"
        )
    if log_cfg.tensorboard_dir is not None:
        files.check_output_dir(
            log_cfg.tensorboard_dir, "tensorboard_dir", "a directory the run can write"
        )


def profile_range(text):
    """profile_steps "A-B" as (A, B), 1 <= A <= B; a ValueError with the fix otherwise."""
    first, _, last = str(text).partition("-")
    if not (first.strip().isdigit() and last.strip().isdigit() and 1 <= int(first) <= int(last)):
        raise ValueError(
            f"profile_steps={text!r} is not a range of iterations A-B with 1 <= A <= B; "
            "give e.g. --profile_steps=5-7"
        )
    return int(first), int(last)


def print0(*args, **kwargs):
    if parallel.grid.rank == 0:
        print(*args, **kwargs, flush=True)


def print_last_rank(text):
    if parallel.grid.rank == parallel.grid.world_size - 1:
        print(text, flush=True)


class Report:
    """Megatron-format lines on stdout; the same scalars to TensorBoard and wandb (offline unless
    configured); every number of an iteration in metrics.jsonl."""

    def __init__(self, log_cfg, schedule, model, save=None, run_config=None):
        """log_cfg: a LoggingConfig; schedule: the run's schedule.Schedule; save: checkpointing's
        directory (metrics.jsonl, TensorBoard and the profile go beside the checkpoints);
        run_config: the whole config as a dict (arguments.to_dict), the run's config in wandb."""
        self.log_cfg, self.schedule = log_cfg, schedule
        self.curriculum = schedule.schedule_cfg.curriculum_learning  # the log line has its seqlen
        self.gpt = parallel.unwrap(model)  # its z-loss accumulator and its FLOPs
        self.peak = peak_flops(next(self.gpt.parameters()).device)  # per GPU; None: MFU n/a
        self.last = None  # (step, lr) of the last trained iteration
        self.restart_interval()
        profile_dir = os.path.join(save or log_cfg.tensorboard_dir or ".", "profile")
        steps = log_cfg.profile_steps
        self.profiler = StepProfiler(steps, profile_dir) if steps else None
        if steps and self.profiler.first > schedule.total_iters:
            print0(
                f"warning: profile_steps {steps} starts after the run's last iteration "
                f"{schedule.total_iters}: no profile is written"
            )
        # with DP replicas to compare, each one's compute time rides in the step's sync (training.agree)
        self.timer = ComputeTimer() if parallel.grid.dp_size > 1 else None
        # torch.compile's graphs so far, and per sequence length
        self.graphs, self.graphs_by_seqlen = 0, {}
        self.tb = self.wandb = self.metrics = None
        if parallel.grid.rank != parallel.grid.world_size - 1:  # the last stage's loss is there
            return
        metrics_dir = save or log_cfg.tensorboard_dir  # beside the checkpoints, else TensorBoard's
        if metrics_dir:
            self.metrics = MetricsFile(os.path.join(metrics_dir, "metrics.jsonl"))
        tb_dir = log_cfg.tensorboard_dir or (save and os.path.join(save, "tensorboard"))
        if tb_dir:  # a writer per x axis: a resume or a rollback hides each one's abandoned steps
            from torch.utils.tensorboard import SummaryWriter

            self.tb = {
                axis: SummaryWriter(os.path.join(tb_dir, axis) if axis != "iterations" else tb_dir)
                for axis in TB_AXES
            }
        mode = os.environ.get("WANDB_MODE", log_cfg.wandb_mode)
        if log_cfg.wandb_project and mode != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=log_cfg.wandb_project, mode=mode, config=run_config, dir=save or "."
            )
            # the x axis is the iteration, a value: wandb's own step only increases, and drops what is logged
            # at a lower one -- every iteration a rollback runs again
            self.wandb.define_metric("iteration")
            self.wandb.define_metric("*", step_metric="iteration")

    # -- the interval between two log lines -------------------------------------------------

    def restart_interval(self):
        """Forget the interval so far (at a log line, and on a new timeline)."""
        self.interval = {"time": 0.0, "iters": 0, "loss": 0.0, "steps": 0, "skipped": 0, "nan": 0}

    def new_timeline(self, state, rollback=False):
        """The run goes on from state's iteration: at its start (a resume, or a fresh run over an
        earlier one's files) and after a rollback. What the files hold past that iteration is an
        abandoned timeline, read as such: a marker in metrics.jsonl (read_metrics drops the
        iterations past it), and in TensorBoard a restart event at each axis's next step, which
        hides that axis's later steps (what SummaryWriter's purge_step writes)."""
        self.restart_interval()
        if self.metrics and (rollback or self.metrics.held_records):
            why = "rollback" if rollback else "resume" if state.iteration else "start"
            self.metrics.timeline(state.iteration, why)
        if self.tb:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            restart, steps = SessionLog(status=SessionLog.START), axis_steps(state.iteration, state)
            for axis, writer in self.tb.items():
                writer.file_writer.add_event(Event(step=steps[axis] + 1, session_log=restart))

    def step(self, step, lr):
        """A trained iteration (a training.Step): its loss into the mean unless NaN, skips counted."""
        self.last = (step, lr)
        self.interval["steps"] += 1
        self.interval["loss"] += step.loss if step.outcome != "nan" else 0.0
        self.interval["skipped"] += step.outcome in ("skipped", "vetoed")
        self.interval["nan"] += step.outcome == "nan"

    def skipped(self, iteration, state, batch_size, why):
        """An iteration whose batch is drawn and thrown away (skip_train_iteration_range, guard)."""
        first, last = state.consumed_samples, state.consumed_samples + batch_size - 1
        print0(
            f" iteration {iteration:8d}/{self.schedule.total_iters:8d} | skipped ({why}): "
            f"samples {first}-{last} not used |"
        )
        self.record(iteration, {"skipped": why})

    def timed(self, seconds):
        """Every iteration's time, skipped ones included."""
        self.interval["time"] += seconds
        self.interval["iters"] += 1

    # -- the log line -----------------------------------------------------------------------

    def log(self, iteration, state, batch_size, seqlen, loss_scale):
        """Megatron's log line, every log_interval iterations. Called on every rank (the z-loss is
        averaged over DP); the last one prints."""
        interval = self.interval
        if self.profiler:
            self.profiler.after(iteration)
        self.count_graphs(seqlen)
        if iteration % self.log_cfg.log_interval or not interval["steps"]:
            return
        step, lr = self.last
        elapsed = interval["time"] / interval["iters"]
        tflops, tokens, mfu = self._throughput(batch_size, seqlen, elapsed)
        progress = self._progress_fields(iteration, state, batch_size, seqlen, elapsed, lr)
        loss_fields, scalars = self._losses(step)
        fields = progress + loss_fields
        fields += [
            ("loss scale", f"{loss_scale:.1f}"),
            ("grad norm", f"{step.grad_norm:.3f}"),
            ("num zeros", f"{float(step.num_zeros):.1f}"),
            ("number of skipped iterations", f"{interval['skipped']:3d}"),
            ("number of nan iterations", f"{interval['nan']:3d}"),
            ("samples per second", f"{batch_size / elapsed:.3f}"),
            ("TFLOPs", f"{tflops:.2f}"),
            ("tokens per second", f"{tokens:.1f}"),
            ("MFU", "n/a" if mfu is None else f"{100 * mfu:.2f}%"),
        ]
        print_last_rank(log_line(fields))
        straggler = self.timer.straggler(iteration) if self.timer is not None else None
        if straggler:
            print(straggler, flush=True)
        self.record(iteration, line_values(fields))
        scalars.update(
            {
                "learning-rate": lr,
                "grad-norm": step.grad_norm,
                "loss-scale": loss_scale,
                "batch-size": batch_size,
                "seqlen": seqlen,
                "consumed-tokens": state.consumed_tokens,
                "tflops": tflops,
                "tokens-per-second": tokens,
            }
            | ({} if mfu is None else {"mfu": mfu})
        )
        self.scalars(scalars, iteration, state)
        self.restart_interval()

    def _throughput(self, batch_size, seqlen, elapsed):
        """(TFLOPs per GPU, tokens per second, MFU or None) of an iteration of elapsed seconds."""
        # Megatron's count (lesson 23)
        flops = self.gpt.config.flops_per_iteration(batch_size, seqlen)
        tflops = flops / (elapsed * parallel.grid.world_size * 1e12)
        tokens = batch_size * seqlen / elapsed  # the whole run's; MFU per GPU, as bench counts it
        mfu = mfu_of(
            self.gpt.config.model_flops_per_iteration(batch_size, seqlen), elapsed, self.peak
        )
        return tflops, tokens, mfu

    def _progress_fields(self, iteration, state, batch_size, seqlen, elapsed, lr):
        """The log line's first fields: where the run is, its time per iteration, lr and batch."""
        fields = [
            ("iteration", f"{iteration:8d}/{self.schedule.total_iters:8d}"),
            ("consumed samples", f"{state.consumed_samples:12d}"),
            ("consumed tokens", f"{state.consumed_tokens:12d}"),
            ("elapsed time per iteration (ms)", f"{elapsed * 1000:.1f}"),
            ("learning rate", f"{lr:.3E}"),
            ("global batch size", f"{batch_size:5d}"),
        ]
        if self.curriculum:
            fields.append(("curriculum seqlen", f"{seqlen:5d}"))
        return fields

    def _losses(self, step):
        """The interval's mean lm loss (NaN iterations left out) and, with z_loss on, its z-loss, as
        the log line's fields and as scalars. On every rank: the z-loss may be averaged over DP."""
        interval = self.interval
        good = interval["steps"] - interval["nan"]
        mean_loss = interval["loss"] / good if good else float("nan")
        fields, scalars = [("lm loss", f"{mean_loss:.6E}")], {"lm-loss": mean_loss}
        if self.gpt.config.z_loss:  # the interval's mean, apart from the lm loss (lesson 20)
            z_loss = step.z_loss  # read in the step's one host sync (training.train_step)
            if z_loss is None:  # DeepSpeed's step, or a logged iteration skipped
                z_loss = parallel.average_loss(self.gpt.pop_z_loss()).item()
            fields.append(("z loss", f"{z_loss:.6E}"))
            scalars["z-loss"] = z_loss
        return fields, scalars

    # -- everything else an iteration may produce -------------------------------------------

    def validation(self, iteration, state, loss, name=None):
        """One validation set's loss: the blended set's under Megatron's names, a named set's (loader's
        valid_weighted_split_names) under the same names + "/NAME" (TensorBoard and wandb group them by the
        prefix: one chart per set, side by side)."""
        ppl = print_validation(loss, iteration, name)
        tail = "" if name is None else f"/{name}"
        self.scalars({f"valid-lm-loss{tail}": loss, f"valid-ppl{tail}": ppl}, iteration, state)
        self.record(iteration, {f"validation lm loss{tail}": loss, f"validation ppl{tail}": ppl})

    def scalars(self, values, step, state):
        """Each scalar against iterations, and in TensorBoard also against consumed samples and
        tokens (Megatron's "lm-loss vs samples"): runs with other batch sizes compare on those."""
        if self.tb:
            steps = axis_steps(step, state)
            for axis, writer in self.tb.items():
                for k, v in values.items():
                    writer.add_scalar(
                        k if axis == "iterations" else f"{k} vs {axis}", v, steps[axis]
                    )
        if self.wandb:  # the counters go along, to be picked as x axis in its UI
            self.wandb.log(
                {
                    **values,
                    "iteration": step,
                    "consumed-samples": state.consumed_samples,
                    "consumed-tokens": state.consumed_tokens,
                }
            )

    def record(self, step, values):
        """Into metrics.jsonl only (the log line's scalars by their log names, lists, decisions)."""
        if self.metrics:
            self.metrics.add(step, values)

    def count_graphs(self, seqlen):
        """torch.compile's graphs compiled since the last call, charged to this sequence length: a line when there
        are new ones (each curriculum length compiles its own, a recompile; many more mean a shape that varies)."""
        # not imported: nothing compiled, nothing to read
        dynamo = sys.modules.get("torch._dynamo.utils")
        total = dynamo.counters["stats"]["unique_graphs"] if dynamo else 0
        if total > self.graphs:
            self.graphs_by_seqlen[seqlen] = (
                self.graphs_by_seqlen.get(seqlen, 0) + total - self.graphs
            )
            print0(
                f"torch.compile: {total - self.graphs} graph(s) compiled at sequence length {seqlen} "
                f"({self.graphs_by_seqlen[seqlen]} at this length, {total} in all)"
            )
            self.graphs = total

    def close(self):
        if self.profiler:
            self.profiler.stop()
        if self.graphs_by_seqlen:
            print0(
                "torch.compile graphs per sequence length: "
                + ", ".join(f"{s}: {n}" for s, n in sorted(self.graphs_by_seqlen.items()))
            )
        if self.metrics:
            self.metrics.close()
        for writer in (self.tb or {}).values():
            writer.close()
        if self.wandb:
            self.wandb.finish()


class ComputeTimer:
    """Each DP replica's compute time per step (forward and backward, not the wait for the gradients' reduction),
    to name a straggler: a slow GPU or host holds every other rank at each collective. CUDA events on a GPU, read
    once the step's one host sync has passed them (no sync of their own); the host clock elsewhere. A step's time
    is gathered with the next step's numbers (agree), so it costs no collective and no sync of its own."""

    def __init__(self):
        self.pending, self.seconds, self.sums = None, 0.0, None

    def start(self, device):
        self.cuda = device.type == "cuda"
        self.pending = (
            [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            if self.cuda
            else [time.perf_counter(), None]
        )
        if self.cuda:
            self.pending[0].record()

    def stop(self):
        if self.cuda:
            self.pending[1].record()
        else:
            self.pending[1] = time.perf_counter()

    def last_seconds(self, device):
        """The last step's compute time on the device, filled there (no host-built tensor copied over)."""
        return torch.full((), self.seconds, dtype=torch.float64, device=device)

    def gathered(self, seconds):
        """Every replica's last reading (from agree), and this step's own, now that the sync has passed it."""
        # (the first gather carries the zeros of no step yet: they add nothing)
        self.sums = [a + b for a, b in zip(self.sums, seconds)] if self.sums else list(seconds)
        if self.pending is not None:
            start, end = self.pending
            self.seconds = start.elapsed_time(end) / 1000 if self.cuda else end - start
            self.pending = None

    def straggler(self, iteration, slack=1.2):
        """The line naming the slowest replica when its mean compute time since the last call is over slack x the
        median of the replicas', printed by that replica (it alone knows its host); clears the sums."""
        sums, self.sums = self.sums, None
        if not sums or len(sums) < 2:
            return None
        median, slowest = statistics.median(sums), max(range(len(sums)), key=sums.__getitem__)
        if sums[slowest] <= slack * median or slowest != parallel.grid.dp_rank:
            return None
        return (
            f" straggler at iteration {iteration}: DP rank {slowest} (rank {parallel.grid.rank}, host "
            f"{socket.gethostname()}) computed {sums[slowest] / median:.2f}x the median of the DP replicas since "
            f"the last log line |"
        )


def mfu_of(model_flops, seconds, peak):
    """Model FLOPs utilisation of one GPU: the model's own FLOPs of an iteration (no recomputation:
    GPTConfig.model_flops_per_iteration, bench.py's count) over the iteration's seconds, the
    processes and the nominal peak; None without a peak (CPU, an unlisted GPU)."""
    if peak is None:
        return None
    return model_flops / (seconds * parallel.grid.world_size * peak)


def log_line(fields):
    """' iteration        5/      20 | consumed samples: ... |', as Megatron-DeepSpeed prints it."""
    return "".join(f" {k}: {v} |" if k != "iteration" else f" iteration {v} |" for k, v in fields)


def line_values(fields):
    """The log line's [(name, text)] as numbers: {"iteration": 45, "train iters": 100, ...};
    MFU's "42.10%" as 42.1 (percent, as printed), its "n/a" as None."""
    out = {}
    for key, text in fields:
        if key == "iteration":
            done, total = text.split("/")
            out["iteration"], out["train iters"] = int(done), int(total)
        elif key == "MFU":
            out[key] = None if text == "n/a" else float(text.rstrip("%"))
        else:
            out[key] = float(text)
    return out


def print_validation(loss, iteration, name=None):
    """Megatron's validation block, or a named set's as Megatron-DeepSpeed prints it ("NAME loss at iteration");
    returns the perplexity."""
    ppl = math.exp(min(20.0, loss))
    line = (
        f" {'validation' if name is None else name} loss at iteration {iteration} | lm loss value: {loss:.6E} | "
        f"lm loss PPL: {ppl:.6E} |"
    )
    print_last_rank("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
    return ppl


TB_AXES = ("iterations", "samples", "tokens")  # in tensorboard_dir, its samples/ and its tokens/


def axis_steps(iteration, state):
    """An iteration's step on each TensorBoard axis (state: the run state after it)."""
    return {
        "iterations": iteration,
        "samples": state.consumed_samples,
        "tokens": state.consumed_tokens,
    }


# -----------------------------------------------------------------------------
# metrics.jsonl


def _drop_a_partial_last_line(path):
    """A run killed inside a write leaves a last line without its newline: appended to, it would run into the
    resumed run's first record and neither would read. That half record is cut (it was never whole)."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        start = max(0, end - 2**20)  # a record is a few kB: its line starts within the last MiB
        f.seek(start)
        cut = f.read().rfind(b"\n")
        if cut >= 0 or start == 0:
            f.truncate(start + cut + 1)


class MetricsFile:
    """Appends one JSON object per iteration to PATH. A list value (a callback's decisions) extends
    the iteration's list under its key; another replaces. A resumed run continues the file, and a
    rollback runs iterations again: each starts a new timeline with a marker record
    {"iteration": N, "timeline": "start", "resume" or "rollback"}; read_metrics reads the file."""

    def __init__(self, path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        _drop_a_partial_last_line(path)
        self.held_records = os.path.exists(path) and os.path.getsize(path) > 0
        self.file = open(path, "a")
        self.record = None

    def timeline(self, iteration, why):
        """The run goes on from iteration (why: "start", "resume" or "rollback")."""
        self.flush()
        self.file.write(json.dumps({"iteration": iteration, "timeline": why}) + "\n")
        self.file.flush()

    def add(self, iteration, values):
        if self.record is not None and self.record["iteration"] != iteration:
            self.flush()
        if self.record is None:
            self.record = {"iteration": iteration}
        for key, value in values.items():
            if isinstance(value, list):  # events (decisions, warnings): an iteration's accumulate
                self.record.setdefault(key, []).extend(value)
            else:
                self.record[key] = value

    def flush(self):
        if self.record is not None:
            self.file.write(json.dumps(self.record) + "\n")
            self.file.flush()
            self.record = None

    def close(self):
        self.flush()
        self.file.close()


def read_metrics(path):
    """{iteration: record} of the timeline a metrics.jsonl (MetricsFile's) ends on, by iteration:
    records of one iteration merged (a list extended, any other value the last); at a timeline
    marker, the iterations past its own are abandoned: their numbers are dropped, their lists
    (decisions, warnings: they were made, a rollback's own among them) kept. A last line without
    its newline is one a run is writing, or was when killed: left out, and said; any other line
    that is no JSON is the file's damage, a ValueError naming the line."""
    with open(path, errors="replace") as f:
        lines = f.readlines()
    records = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            if number == len(lines) and not line.endswith("\n"):
                print(f"{path}: its last line is cut short (a run writing it, or killed): skipped")
                break
            raise ValueError(
                f"{path} line {number} is not a JSON record ({e}): the file is damaged there; "
                "remove or repair that line"
            ) from None
        n = record["iteration"]
        if "timeline" in record:
            for i in [i for i in records if i > n]:
                events = {k: v for k, v in records.pop(i).items() if isinstance(v, list)}
                if events:
                    records[i] = {"iteration": i, **events}
            continue
        merged = records.setdefault(n, {"iteration": n})
        for key, value in record.items():
            if isinstance(value, list) and isinstance(merged.get(key), list):
                merged[key] = merged[key] + value
            else:
                merged[key] = value
    return dict(sorted(records.items()))


# -----------------------------------------------------------------------------
# profile_steps


class StepProfiler:
    """A torch.profiler trace of iterations A to B (profile_steps "A-B"), CPU and CUDA activity, in Chrome's
    format (chrome://tracing, Perfetto, TensorBoard's profiler plugin), one file per rank; on CUDA also the
    allocator's history (torch.cuda.memory._record_memory_history), a snapshot for pytorch.org/memory_viz. Both
    in <save or tensorboard_dir or .>/profile. Started when iteration A-1 has been logged, stopped after B."""

    def __init__(self, profile_steps, directory):
        self.first, self.last = profile_range(profile_steps)
        self.directory = directory
        self.profile = None
        if self.first == 1:
            self.start()

    def start(self):
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if torch.cuda.is_initialized() else []
        )
        if torch.cuda.is_initialized():
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.profile = profile(activities=activities, record_shapes=True, with_stack=False)
        self.profile.__enter__()

    def after(self, iteration):
        if iteration == self.first - 1 and self.profile is None:
            self.start()
        elif iteration >= self.last and self.profile is not None:
            self.stop()

    def stop(self):
        if self.profile is None:
            return
        import torch

        self.profile.__exit__(None, None, None)
        os.makedirs(self.directory, exist_ok=True)
        name = f"rank{parallel.grid.rank}"
        self.profile.export_chrome_trace(os.path.join(self.directory, f"{name}.trace.json"))
        if torch.cuda.is_initialized():
            torch.cuda.memory._dump_snapshot(os.path.join(self.directory, f"{name}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        print0(f"profile of iterations {self.first}-{self.last}: {self.directory}")
        self.profile, self.first = None, 0  # once
