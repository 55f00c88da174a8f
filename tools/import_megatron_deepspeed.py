"""Import a Megatron-DeepSpeed checkpoint (tr8b-104B, tr11-176B: layer files, mp_rank_* states, ZeRO-1 optimizer
partitions) as a checkpoint of ours, so that train.py continues the run where Megatron-DeepSpeed stopped.

    python tools/import_megatron_deepspeed.py --load checkpoints/tr8b-104B --save out/tr8b-104B-here
    python train.py config/tr8b_104b.py --load out/tr8b-104B-here --save out/tr8b-104B-here

It writes the checkpoint `latest` names (or the global_stepN directory given) with the weights, the fp32 master
weights, Adam's moments and step, the iteration, consumed samples and tokens and the LR schedule, in the source's
TP size and --pipeline_model_parallel_size stages (default the source's), DP=1; train.py loads it with any TP x
PP x DP layout (reshard.py). Without ZeRO files the weights alone are imported, and the output says so.
DeepSpeed's universal checkpoint (ds_to_universal's output, or the directory with its latest_universal) is read
too. It holds one output (stage, TP rank)'s state at a time, reading the source files memory-mapped: more stages
(--pipeline_model_parallel_size) need less memory. The format and its limits: megatron_ds.py.
"""

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron_ds  # noqa: E402


class Terminated(BaseException):
    """SIGTERM, raised where the import is: convert removes what it wrote, then it exits 143."""


def _terminate(signum, frame):
    raise Terminated(signal.Signals(signum).name)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--load", required=True, help="Megatron-DeepSpeed checkpoint directory (its --save)"
    )
    parser.add_argument("--save", required=True, help="new directory for our checkpoint")
    parser.add_argument(
        "--vocab_size",
        type=int,
        default=None,
        help="the tokenizer's vocabulary size (default: 50257 for GPT2BPETokenizer)",
    )
    parser.add_argument(
        "--pipeline_model_parallel_size",
        type=int,
        default=None,
        help="stages of the written checkpoint (default: the source's; any layout loads it)",
    )
    parser.add_argument("--pp_partition_method", default=None, help="default: the source's")
    parser.add_argument(
        "--padded_vocab_in_softmax",
        default="true",
        choices=["true", "false"],
        help="true (default): Megatron's softmax over the padded vocabulary too, the model it "
        "trained (its TP size then stays); false: the padding left out from now on",
    )
    args = parser.parse_args(argv)
    stages = args.pipeline_model_parallel_size
    if stages is not None and stages < 1:
        raise ValueError(
            f"--pipeline_model_parallel_size {stages} must be at least 1: the stages of the "
            "written checkpoint; leave it out for the source's"
        )
    megatron_ds.check_save_dir(args.save, args.load)  # before the source is read
    ckpt = megatron_ds.Checkpoint(args.load)
    cfg = megatron_ds.config_from_args(
        ckpt,
        args.vocab_size,
        args.pipeline_model_parallel_size,
        args.pp_partition_method,
        args.padded_vocab_in_softmax == "true",
    )
    # SIGTERM's default ends the process where it is, leaving global_stepN.partial behind
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return megatron_ds.convert(ckpt, args.save, cfg)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Terminated as e:
        print(
            f"error: the import was stopped by {e}; what it had written is removed: run it again",
            file=sys.stderr,
        )
        sys.exit(143)
