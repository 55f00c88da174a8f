"""Downstream evaluation of a checkpoint of any layout with lm-evaluation-harness (lm-eval's tasks, as they are).

    python tools/evaluate.py --load out/tiny --tasks hellaswag,lambada_openai [--num_fewshot 0 --batch_size 8
        --limit 100 --output_path results.json]
    python tools/evaluate.py --load out/tiny --tasks stablegpt_choice --include_path tests/data/eval_tasks \
        --only_include_path

Reads DIR/latest, gathers the model into one process (CPU, or CUDA when available) as tools/sample.py does, and
runs lm_eval.simple_evaluate with eval_harness.StableGPT: log-likelihoods, rolling log-likelihoods and greedy
generation from our model and the run's tokenizer. Prints lm-eval's table; --output_path writes its results as
JSON (with each document's requests and answers under --log_samples). A task of your own is a YAML file in a
folder given to --include_path (tests/data/eval_tasks holds three that read local JSONL files);
--only_include_path skips indexing lm-eval's ~14,700 built-in tasks (several seconds).
"""

import argparse
import json
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
# this file would stand in for Hugging Face's `evaluate`, which lm-eval may import
if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import arguments  # noqa: E402
import checkpoint  # noqa: E402
import eval_harness  # noqa: E402 (it imports lm-eval when it is used)
import files  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--load", required=True, help="checkpoint directory (the run's save directory)"
    )
    parser.add_argument(
        "--tasks", required=True, help="comma-separated lm-eval task names (globs allowed)"
    )
    parser.add_argument(
        "--num_fewshot", type=int, default=None, help="examples in each prompt (task's default)"
    )
    parser.add_argument("--batch_size", type=int, default=1, help="requests per forward pass")
    parser.add_argument(
        "--limit", type=float, default=None, help="documents per task (a fraction if < 1)"
    )
    parser.add_argument(
        "--include_path", default=None, help="a folder of task YAML files of your own"
    )
    parser.add_argument(
        "--only_include_path",
        action="store_true",
        help="look tasks up in --include_path only, not among lm-eval's built-in tasks",
    )
    parser.add_argument("--output_path", default=None, help="write lm-eval's results here as JSON")
    parser.add_argument(
        "--log_samples", action="store_true", help="with --output_path: each document's answers"
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda or cuda:N; auto (default): CUDA when available, else the CPU",
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="cast the model (default: as saved)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="of lm-eval's few-shot sampling")
    parser.add_argument(
        "--tokenizer_file", default=None, help="tokenizer.json if not the checkpoint's own"
    )
    args = parser.parse_args(argv)
    check_device(args)
    if not any(args.tasks.split(",")):
        raise ValueError(
            f"--tasks {args.tasks!r} names no task: give lm-eval task names, comma-separated"
        )
    if args.only_include_path and not args.include_path:
        raise ValueError("--only_include_path needs --include_path (the folder of your task files)")
    if args.include_path and not os.path.isdir(args.include_path):
        raise ValueError(f"--include_path {args.include_path} is not a directory")
    if (
        args.batch_size < 1
        or (args.num_fewshot or 0) < 0
        or (args.limit is not None and args.limit <= 0)
    ):
        raise ValueError(
            "--batch_size must be at least 1, --num_fewshot not negative and --limit positive"
        )
    if args.log_samples and not args.output_path:
        # the answers go into the results file only: without one they are computed and lost
        raise ValueError(
            "--log_samples writes each document's answers into --output_path's results: "
            "give --output_path too"
        )
    if args.output_path:
        check_output_path(args.output_path)
    return args


def check_device(args):
    """A --device this machine lacks refused before the checkpoint and lm-eval's index are read (torch's
    traceback when the model moves otherwise), in train.py's words (arguments.check_device); auto resolved."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(args.device).type
    except RuntimeError:
        raise ValueError(
            f"--device {args.device} is not a device; give cpu, cuda or cuda:N"
        ) from None
    # one process: the LOCAL_WORLD_SIZE of a launcher around it is not this tool's
    arguments.check_device(types.SimpleNamespace(device=kind), local_world_size=1)


def check_output_path(path):
    """Refuse, before the evaluation, an --output_path the results could not be written to (lost
    after the whole evaluation otherwise), or a file that is not lm-eval results (this tool writes
    over nothing it did not write)."""
    files.check_output_file(
        path,
        "--output_path",
        "results.json",
        (
            lambda p: files.json_holds(p, ["results"]),
            "lm-eval results",
            "this tool writes over its own results only",
        ),
    )


def write_results(results, path):
    """The results as JSON at path, whole or not at all (files.replaced). An OS error names
    --output_path."""
    import lm_eval.utils

    try:
        with files.replaced(path) as tmp, open(tmp, "w") as f:
            json.dump(results, f, indent=2, default=lm_eval.utils.handle_non_serializable)
    except OSError as e:
        raise ValueError(
            f"--output_path {path}: the results cannot be written "
            f"({e.strerror or e}); the table above holds them"
        ) from None


def main(argv=None):
    args = parse(argv)
    checkpoint.check_directory(args.load)  # before lm-eval's import and index: a typo costs no wait
    manager = eval_harness.task_manager(args.include_path, args.only_include_path)
    names = [t for t in args.tasks.split(",") if t]
    tasks = eval_harness.known_tasks(names, manager, args.include_path)
    import lm_eval.utils

    lm = eval_harness.StableGPT.from_checkpoint(
        args.load,
        device=args.device,
        dtype=DTYPES.get(args.dtype),
        tokenizer_file=args.tokenizer_file,
        batch_size=args.batch_size,
    )
    results = eval_harness.evaluate(
        lm, tasks, manager, args.num_fewshot, args.limit, args.log_samples, args.seed
    )
    print(lm_eval.utils.make_table(results))
    if "groups" in results:
        print(lm_eval.utils.make_table(results, "groups"))
    if args.output_path:
        write_results(results, args.output_path)
        print(f"results written to {args.output_path}")
    return results


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
