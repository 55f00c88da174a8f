"""Pre-train a GPT.

    python train.py                                # tiny model on bundled Shakespeare, CPU, minutes
    python train.py config/gpt2_125m.py --lr=3e-4   # a config file, then --key=value overrides
    torchrun --nproc_per_node 8 train.py config/tr8b_104b.py

One iteration consumes one global batch: micro-batches are accumulated (and pipelined across stages),
gradients are reduced across data-parallel ranks, clipped, and the optimizer steps -- unless the
step is skipped (fp16 overflow, NaN loss, skip_grad_norm_above) or the whole iteration is
(skip_train_iteration_range). This file is the script and its loop (`run`); nothing imports it. The step is
training.py's, what each iteration does is schedule.py's, what is built is builders.py's.

The stability layer (stability/: the spike guard, its snapshots, fault injection, telemetry, skip lists,
the soft skip) is a list of callbacks (training.Callback) the loop calls at a few named points; the loop knows
nothing else of it. With no stability switch set none of its modules is imported (tests/test_structure.py
keeps it so).

Every number that decides what happens next is in the checkpoint, and the sample order is a function
of consumed samples only, so a resumed run is bit-exact.
"""

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    import usage  # reads the keys from the source: help prints before torch is imported

    usage.print_help()
    sys.exit(0)

import time

import arguments
import builders
import checkpoint
import cross_entropy
import eval_harness
import launch
import loader
import parallel
import run_state
import safety
import training  # train_step, evaluate called as training.X: where a test's spy replaces them
from checkpoint import CheckpointConfig
from model import GPTConfig
from report import LoggingConfig, Report, print0
from schedule import Schedule, ScheduleConfig
from sections import section
from training import NO_CALLBACKS, Iteration, StopRun


def main(argv=None):
    # exit_duration_in_mins counts from here (Megatron's clock starts with pretrain): the build, the load and the
    # data's index take minutes at scale, and a job limit counts them
    job_start = time.time()
    cfg = arguments.load_config(argv)
    arguments.check_device(cfg)
    if cfg.dry_run:  # sizes the TP x PP x DP layout on the meta device, starting no process
        import estimate  # it sizes the stability layer's snapshots too: imported for a dry run only

        estimate.dry_run(cfg)
        return
    # a config that cannot work stops before any process group, and so do a tokenizer, data files and init_from_hf
    # weights it cannot use
    arguments.prepare(cfg, launch.world_size())
    loader.check_tokenizer(cfg.tokenizer_file, section(loader.DataContext, cfg))
    loader.check_files(section(loader.DataConfig, cfg), section(loader.DataContext, cfg))
    builders.check_init_from_hf(cfg)
    # lm-eval's tasks found (imported only then), before any process group too
    harness = None
    if cfg.eval_harness_tasks:
        harness = eval_harness.RunEvaluation(
            section(eval_harness.EvalHarnessConfig, cfg),
            section(GPTConfig, cfg),
            cfg.tokenizer_file,
        )
    grid = launch.start(
        section(parallel.LayoutConfig, cfg), cfg.tensor_model_parallel_size, cfg.save
    )
    # Before anything is built or written: which checkpoint to resume, is it this model, is save ours (lock).
    # The checkpoint writer inside: a save in flight is on disk before the lock is released.
    with safety.RunLock(cfg) as run_lock, checkpoint.AsyncWriter(cfg.async_save) as writer:
        callbacks = builders.build_callbacks(cfg, writer, run_lock.saved_state)
        return run(cfg, grid, run_lock, job_start, writer, callbacks, harness)


def run(cfg, grid, run_lock, job_start, writer=None, callbacks=NO_CALLBACKS, harness=None):
    """Train (or, with eval_only, evaluate) the configured model; returns the run state. run_lock: safety.RunLock
    (its exit_signal() asks to save and stop on SIGTERM or SIGUSR1; its saved_state: the checkpoint's run state);
    job_start: time.time() at the job's start, exit_duration_in_mins's clock; writer: the checkpoint.AsyncWriter
    saves go through (None: synchronous); harness: lm-eval's tasks, or None."""
    parts, device, train_data, valid_data = prepare(cfg, grid, callbacks, run_lock.saved_state)
    model, state, schedule = parts.model, parts.state, parts.schedule
    if cfg.eval_only:
        return evaluate_checkpoint(cfg, parts, device, valid_data)
    report = Report(section(LoggingConfig, cfg), schedule, model, cfg.save, arguments.to_dict(cfg))
    report.new_timeline(state)  # a resume: the files' iterations past it are abandoned
    callbacks.start(parts, report, train_data)
    ckpt_cfg = section(CheckpointConfig, cfg)

    def exit_reason(n):  # a signal, the job's time up, exit_interval (safety.py)
        return safety.exit_reason(ckpt_cfg, n, job_start, run_lock.exit_signal)

    model.train()
    # closed however the loop ends (a callback's StopRun too): no thread is left loading when the process exits
    with loader.batch_prefetcher(train_data, schedule, device) as prefetcher:
        while not schedule.done(state):
            t0, n, first = time.time(), state.iteration + 1, state.consumed_samples
            it = Iteration(n, first, schedule.batch_size(first), schedule.seqlen(n))
            skip = "skip_train_iteration_range" if schedule.skipped(n) else callbacks.skip(n)
            if skip:  # drawn and thrown away: later iterations see the batches an unskipped run sees (lesson 9)
                step = training.skipped_step(skip)
                report.skipped(n, state, it.batch_size, step.outcome)
            else:  # the batch, its learning rate, the step
                key = (n, first, it.batch_size, it.seqlen)  # the batch the prefetcher loaded ahead
                it.batches = loader.to_device(prefetcher.get(key), device)
                it.lr = schedule.lr_at(n, state)
                callbacks.before_step(it)
                # the step computes, the callbacks decide, then the core applies
                step = training.whole_step(
                    parts.model,
                    parts.optimizer,
                    parts.scaler,
                    it.batches,
                    it.lr,
                    parts.rules,
                    device,
                    callbacks,
                    count_zeros=n % cfg.log_interval == 0,  # a pass over the gradients: logged only
                    timer=report.timer,
                )
                step = callbacks.check_step(it, step)
                report.step(step, it.lr)
            state.advance(it.batch_size, it.seqlen, applied=step.outcome == "ok", step=step)
            report.timed(time.time() - t0)
            if not skip and callbacks.after_step(it, step):  # the stability layer rolled back
                report.new_timeline(state, rollback=True)
                continue
            # log, check, evaluate, save; stop when the job's time is up
            if log_and_save(
                cfg, grid, parts, it, report, device, valid_data, harness, writer, exit_reason
            ):
                break
    finish(cfg, parts, report, device)
    return state


def log_and_save(cfg, grid, parts, it, report, device, valid_data, harness, writer, exit_reason):
    """After a step that stands: the log line, the TP replicas checked (lesson 18), the validation
    data and lm-eval's tasks (harness) evaluated, the run saved; returns why the run exits now
    (exit_reason(iteration)), or None."""
    n, state, model = it.number, parts.state, parts.model
    report.log(n, state, it.batch_size, it.seqlen, parts.scaler.scale)
    check = cfg.tp_replica_check_interval
    if grid.tp_size > 1 and check and n % check == 0:
        parallel.log_tp_replicas(model, parts.optimizer, n, cfg.tp_replica_resync)
    last = parts.schedule.done(state)
    if valid_data is not None and cfg.eval_iters > 0 and (last or n % cfg.eval_interval == 0):
        for name, valid in loader.validation_sets(valid_data):  # the blend, or each set
            report.validation(n, state, training.evaluate(model, valid, parts.rules, device), name)
    if harness is not None and harness.due(n, last):  # lm-eval's tasks, logged beside it
        harness(model, n, state, report, device)
    # save, and stop when the job's time is up
    why_exit = exit_reason(n)
    if cfg.save and (last or why_exit or (cfg.save_interval and n % cfg.save_interval == 0)):
        run_state.save(parts, writer)
    parts.callbacks.after_iteration(n)
    if why_exit:
        print0(f"exiting at iteration {n} ({why_exit})")
    return why_exit


def finish(cfg, parts, report, device):
    """The run's end: the report and the callbacks closed, a sample printed, DeepSpeed released."""
    report.close()
    parts.callbacks.close()
    print_sample(cfg, parts.model, device)
    if cfg.deepspeed:
        parts.optimizer.close()  # DeepSpeed's released before the process groups (launch.shut_down)


def evaluate_checkpoint(cfg, parts, device, valid_data):
    """eval_only: the checkpoint's validation loss, and its sample when sample_tokens asks for one."""
    training.evaluate_only(parts.model, valid_data, parts.state, parts.rules, device, cfg.split)
    print_sample(cfg, parts.model, device)
    return parts.state


def print_sample(cfg, model, device):
    training.print_sample(
        model, device, cfg.sample_tokens, cfg.sample_prompt, cfg.tokenizer_file, cfg.seed
    )


def prepare(cfg, grid, callbacks, saved_state):
    """This rank's parts of the run (run_state.Parts), resumed from a checkpoint if there is one, on its device,
    and the data: (parts, device, train data, validation data). saved_state: the checkpoint's run state, or None
    (the schedule's totals, the data's length, go on from it)."""
    device = launch.setup(section(parallel.LayoutConfig, cfg), cfg.seed)
    builders.check_attention(cfg, device)  # the first step's refusal, before the build
    schedule = Schedule(section(ScheduleConfig, cfg), grid.dp_size, cfg.seq_length, saved_state)
    # the data before the model: its refusals (token ids outside the vocabulary, the bundled corpus's splits) need
    # the corpus read, which the preflight does not do, and would come after minutes of build on every rank
    data_cfg, context = section(loader.DataConfig, cfg), section(loader.DataContext, cfg)
    skips = callbacks.documents_to_skip
    train_data, valid_data = loader.build_data(data_cfg, context, schedule, skips)
    parts = builders.build(cfg, grid, schedule, device, callbacks)
    if cfg.load:
        run_state.load(parts)
    # each block one graph, checkpointing outside it; the loss's elementwise chain fused
    if launch.compiles(section(parallel.LayoutConfig, cfg)):
        parallel.unwrap(parts.model).compile_blocks()
        cross_entropy.compile_chain()
    return parts, device, train_data, valid_data


if __name__ == "__main__":
    # torchrun and SLURM put every rank's stdout on one pipe or file: a line goes out whole, in one write, so that
    # no rank's line lands inside another's. Block buffering splits lines at the buffer's end; unbuffered (torchrun
    # starts its workers with -u) print writes the text and its newline apart, and another rank's line can come
    # between them.
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    finished = False
    try:
        main()
        finished = True
    except (ValueError, FileNotFoundError) as e:
        launch.exit_with(e, 2)
    # a callback stopped the run (the spike guard's caps): saved, with its message
    except StopRun as e:
        launch.exit_with(e, e.exit_code)
    finally:
        launch.shut_down(finished)
