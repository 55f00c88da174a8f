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

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":  # this file would stand in for Hugging Face's `evaluate`, which lm-eval may import
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (the run's save directory)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (globs allowed)")
    parser.add_argument("--num_fewshot", type=int, default=None, help="examples in each prompt (task's default)")
    parser.add_argument("--batch_size", type=int, default=1, help="requests per forward pass")
    parser.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    parser.add_argument("--include_path", default=None, help="a folder of task YAML files of your own")
    parser.add_argument("--only_include_path", action="store_true",
                        help="look tasks up in --include_path only, not among lm-eval's built-in tasks")
    parser.add_argument("--output_path", default=None, help="write lm-eval's results here as JSON")
    parser.add_argument("--log_samples", action="store_true", help="with --output_path: each document's answers")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the model (default: as saved)")
    parser.add_argument("--seed", type=int, default=1234, help="of lm-eval's few-shot sampling")
    args = parser.parse_args(argv)
    if args.only_include_path and not args.include_path:
        raise ValueError("--only_include_path needs --include_path (the folder of your task files)")
    if args.include_path and not os.path.isdir(args.include_path):
        raise ValueError(f"--include_path {args.include_path} is not a directory")
    if args.batch_size < 1 or (args.num_fewshot or 0) < 0 or (args.limit is not None and args.limit <= 0):
        raise ValueError("--batch_size must be at least 1, --num_fewshot not negative and --limit positive")
    if args.output_path:
        check_output_path(args.output_path)
    return args


def check_output_path(path):
    """Refuse, before the evaluation, an --output_path the results could not be written to (lost
    after the whole evaluation otherwise), or a file that is not lm-eval results (this tool writes
    over nothing it did not write)."""
    if os.path.isdir(path):
        raise ValueError(f"--output_path {path} is a directory; give a file name, e.g. "
                         f"{os.path.join(path, 'results.json')}")
    if os.path.exists(path) and not _results_file(path):
        raise ValueError(f"--output_path {path} exists and is not lm-eval results: give another "
                         "file (this tool writes over its own results only)")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # the folders the write creates: the first one there decides
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"--output_path {path} cannot be written: {parent} is a file, not a "
                         "directory; give another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--output_path {path} cannot be written: {parent} is not writable; give "
                         "another path")


def _results_file(path):
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and "results" in found


def write_results(results, path):
    """The results as JSON at path, through a temporary file: a killed write leaves the old file or
    none. An OS error names --output_path."""
    import lm_eval.utils
    tmp = f"{path}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(results, f, indent=2, default=lm_eval.utils.handle_non_serializable)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ValueError(f"--output_path {path}: the results cannot be written "
                         f"({e.strerror or e}); the table above holds them") from None


def task_manager(include_path=None, only_include_path=False):
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=include_path, include_defaults=not only_include_path)


def known_tasks(names, manager):
    """The tasks, groups or tags names stand for (a glob: every one it matches, in order), each one lm-eval
    knows, or a ValueError naming those it does not."""
    matches = {n: manager.match_tasks([n]) for n in names}
    unknown = [n for n, found in matches.items() if not found]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}: `lm-eval list tasks` lists lm-eval's; a task of "
                         "your own is a YAML file in the folder given to --include_path")
    return list(dict.fromkeys(t for found in matches.values() for t in found))


def evaluate(lm, tasks, manager, num_fewshot=None, limit=None, log_samples=False, seed=1234):
    """lm_eval.simple_evaluate's results of the LM lm on tasks (names manager knows); its batch size and device
    recorded in the results' config."""
    import lm_eval
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                   batch_size=lm.batch_size, device=str(lm.device),
                                   task_manager=manager, log_samples=log_samples, random_seed=seed,
                                   numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)


def main(argv=None):
    args = parse(argv)
    if not os.path.isdir(args.load):  # before lm-eval's import and index: a typo costs no wait
        raise ValueError(f"checkpoint directory {args.load} does not exist")
    manager = task_manager(args.include_path, args.only_include_path)
    tasks = known_tasks([t for t in args.tasks.split(",") if t], manager)
    import lm_eval.utils

    import eval_harness
    lm = eval_harness.StableGPT.from_checkpoint(args.load, device=args.device, dtype=DTYPES.get(args.dtype),
                                                batch_size=args.batch_size)
    results = evaluate(lm, tasks, manager, args.num_fewshot, args.limit, args.log_samples, args.seed)
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
