"""Print the text of the samples that iterations A..B of a run consumed -- to find the input behind a spike.

    python tools/show_samples.py config/tr8b_104b.py --iterations 13251-13260 [--key=value ...]

The 104B team switched to logging every iteration "in case we need to remap samples to text to find a
really bad text input" (lesson 9). The sample order is a function of the config (data, split, seed, batch
ramp-up, curriculum) and of the consumed samples only, so it can be replayed without the checkpoint: from the
run's own log where there is one (metrics.jsonl in the config's save directory: the consumed samples of the last
logged iteration before A, so a resume that changed the global batch is followed), else from iteration 0. An
iteration of A..B whose logged count differs from the replay is said: the run's keys were not these.
Skipped iterations (skip_train_iteration_range) are listed too: their batches were drawn and thrown away. A skip
list (skip_documents) is the run's: give it as the run did. A global_batch_size left to the layout is the run's
checkpoint's in save (without one, one replica's, said).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import arguments  # noqa: E402
import builders  # noqa: E402
import checkpoint  # noqa: E402
import data  # noqa: E402
import loader  # noqa: E402
import report  # noqa: E402
import safety  # noqa: E402
import schedule  # noqa: E402
from sections import section  # noqa: E402


def logged_progress(save):
    """{iteration: (consumed samples, consumed tokens) after it} of the run's metrics.jsonl in save (the timeline
    it ends on: report.read_metrics), or {} without one."""
    path = os.path.join(save, "metrics.jsonl") if save else None
    if path is None or not os.path.exists(path):
        return {}
    return {
        i: (int(r["consumed samples"]), int(r["consumed tokens"]))
        for i, r in report.read_metrics(path).items()
        if "consumed samples" in r
    }


def iteration_starts(plan, first, last, logged):
    """{iteration: (first consumed sample, global batch size, seqlen, note)} for iterations first..last: from the
    run's last logged iteration before first, each batch the run's own where the log has the iteration after a
    known count (log_interval 1: exact whatever the keys), else the plan's (a count the log then contradicts is
    said in the note). logged: logged_progress's."""
    done = max((i for i in logged if i < first), default=0)
    out, (consumed, tokens), known = {}, logged.get(done, (0, 0)), True
    for it in range(done + 1, last + 1):
        batch, seqlen, note = plan.batch_size(consumed), plan.seqlen(it), ""
        if it in logged and logged[it][0] != consumed + batch:
            if known:
                note = f" (the run's batch, from its log; these keys' is {batch})"
                batch = logged[it][0] - consumed
            else:
                note = (
                    f" -- but the run's log has {logged[it][0]} samples consumed after it, not {consumed + batch}: "
                    "the run's keys (global_batch_size, rampup_batch_size) were not these"
                )
        if it in logged and known and logged[it][1] - tokens != batch * seqlen:
            # samples of another length are another sample index (a context extended on resume)
            ran = (logged[it][1] - tokens) // batch
            note += f" -- the run trained at seqlen {ran} here (its log): give --seq_length={ran} for its samples"
        if it >= first:
            out[it] = (consumed, batch, seqlen, note)
        consumed, known = consumed + batch, it in logged
        tokens = logged[it][1] if known else tokens + batch * seqlen
    return out


def run_batch(cfg):
    """The global batch of a config that leaves it to the run's layout (micro_batch_size x its
    data-parallel size, which the config does not hold): the run's, from its checkpoint in save,
    else one replica's, said."""
    tag = checkpoint.latest_dir(cfg.save) if cfg.save and os.path.isdir(cfg.save) else None
    if tag is not None:
        batch = safety.checkpoint_run(tag)["config"]["global_batch_size"]
        print(f"global_batch_size unset: the run's, {batch}, from its checkpoint {tag}")
        return batch
    print(
        f"global_batch_size unset and no checkpoint in save ({cfg.save}): replayed as one "
        f"data-parallel replica's, micro_batch_size {cfg.micro_batch_size}; give "
        "--global_batch_size=N if the run had more"
    )
    return cfg.micro_batch_size


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--iterations", required=True, help="A-B, 1-based and inclusive, as in the log"
    )
    parser.add_argument(
        "--max_chars",
        type=int,
        default=2000,
        help="truncate each sample's text to this; 0: the samples' headers only",
    )
    args, rest = parser.parse_known_args(argv)
    if args.max_chars < 0:  # a slice's negative end: each text silently cut at its end instead
        raise ValueError(f"--max_chars {args.max_chars} must be 0 (headers only) or more")
    ((first, last),) = schedule.parse_iteration_ranges([args.iterations], key="--iterations")
    cfg = arguments.load_config(rest)
    if cfg.global_batch_size is None:
        cfg.global_batch_size = run_batch(cfg)
    # The order depends on the global batch only, not on the data-parallel size: validate as one replica.
    arguments.prepare(
        cfg, world_size=cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size
    )
    logged = logged_progress(cfg.save)
    # the run's length from where its log ends, as its resume would go on (Schedule's start)
    newest = max(logged, default=0)
    samples, tokens = logged.get(newest, (0, 0))
    start = {"iteration": newest, "consumed_samples": samples, "consumed_tokens": tokens}
    plan = schedule.Schedule(section(schedule.ScheduleConfig, cfg), 1, cfg.seq_length, start)
    anchor = max((i for i in logged if i < first), default=0)
    samples = logged.get(anchor, (0, 0))[0]
    if last > plan.total_iters:
        raise ValueError(
            f"iteration {last} is past the end of this run ({plan.total_iters} iterations)"
        )
    if logged:
        print(
            f"the consumed samples from the run's log, {cfg.save}/metrics.jsonl (replayed from iteration "
            f"{anchor + 1}, after {samples} samples)"
        )
    else:  # a run that changed its batch on a resume is not followed: said
        where = f"in save ({cfg.save})" if cfg.save else "(no save directory)"
        print(f"no metrics.jsonl {where}: replayed by these keys from iteration 1")
    starts = iteration_starts(plan, first, last, logged)
    end = max(begin + batch for begin, batch, _, _ in starts.values())
    if end > plan.total_samples:
        raise ValueError(
            f"iterations {first}-{last} consumed samples up to {end}, past these keys' {plan.total_samples}: the "
            "run's keys (train_iters, train_samples, global_batch_size) were not these"
        )
    data.get_tokenizer(cfg.tokenizer_file)  # a missing one said before the sample index is built
    data_cfg, context = section(loader.DataConfig, cfg), section(loader.DataContext, cfg)
    # the documents the run's callbacks leave out (skip_documents): the run's sample index is built without them
    skips = builders.build_callbacks(cfg).documents_to_skip
    train_data, _ = loader.build_data(data_cfg, context, plan, skips)
    for it, (begin, batch, seqlen, note) in starts.items():
        if plan.skipped(it):
            note += " (skipped by skip_train_iteration_range)"
        print(f"=== iteration {it}: samples {begin}-{begin + batch - 1}, seqlen {seqlen}{note}")
        for i in range(begin, begin + batch):
            print(f"--- sample {i} ({len(train_data[i][: seqlen + 1])} tokens)")
            print(data.sample_text(train_data, i, seqlen, args.max_chars, cfg.tokenizer_file))


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
