"""Print the text of the samples that iterations A..B of a run consumed -- to find the input behind a spike.

    python tools/show_samples.py config/tr8b_104b.py --iterations 13251-13260 [--key=value ...]

The 104B team switched to logging every iteration "in case we need to remap samples to text to find a
really bad text input" (lesson 9). The sample order is a function of the config (data, split, seed, batch
ramp-up, curriculum) and of the consumed samples only, so it can be replayed without the checkpoint.
Skipped iterations (skip_train_iteration_range) are listed too: their batches were drawn and thrown away.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import arguments  # noqa: E402
import data  # noqa: E402
import loader
import schedule  # noqa: E402
from sections import section  # noqa: E402


def iteration_starts(plan, last):
    """{iteration: (first consumed sample, global batch size, seqlen)} for iterations 1..last."""
    out, consumed = {}, 0
    for it in range(1, last + 1):
        batch = plan.batch_size(consumed)
        out[it] = (consumed, batch, plan.seqlen(it))
        consumed += batch
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--iterations", required=True, help="A-B, 1-based and inclusive, as in the log"
    )
    parser.add_argument(
        "--max_chars", type=int, default=2000, help="truncate each sample's text to this"
    )
    args, rest = parser.parse_known_args(argv)
    ((first, last),) = schedule.parse_iteration_ranges([args.iterations], key="--iterations")
    cfg = arguments.load_config(rest)
    # The order depends on the global batch only, not on the data-parallel size: validate as one replica.
    arguments.prepare(
        cfg, world_size=cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size
    )
    plan = schedule.Schedule(section(schedule.ScheduleConfig, cfg), 1, cfg.seq_length)
    if last > plan.total_iters:
        raise ValueError(
            f"iteration {last} is past the end of this run ({plan.total_iters} iterations)"
        )
    data_cfg, context = section(loader.DataConfig, cfg), section(loader.DataContext, cfg)
    train_data, _ = loader.build_data(data_cfg, context, plan)
    for it, (start, batch, seqlen) in iteration_starts(plan, last).items():
        if it < first:
            continue
        note = " (skipped by skip_train_iteration_range)" if plan.skipped(it) else ""
        print(f"=== iteration {it}: samples {start}-{start + batch - 1}, seqlen {seqlen}{note}")
        for i in range(start, start + batch):
            print(f"--- sample {i} ({len(train_data[i][: seqlen + 1])} tokens)")
            print(data.sample_text(train_data, i, seqlen, args.max_chars, cfg.tokenizer_file))


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
