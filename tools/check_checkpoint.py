"""Check that a checkpoint is whole, without a GPU and without building the model's weights.

    python tools/check_checkpoint.py out/tiny                  # the checkpoint `latest` names
    python tools/check_checkpoint.py out/tiny/global_step300   # that one

1. files: every file the layout needs (the model shard of each TP rank and stage, the optimizer file of each
   rank) is there with the size and CRC-32 its manifest lists;
2. shapes: each model shard holds exactly the parameters, with their shapes, of that rank's stage of the model
   the stored config builds (on the meta device);
3. replicas: the parameters replicated over TP (LayerNorms, row-parallel biases) are bitwise equal in every TP
   rank's file (lesson 18), and so are the two copies of the tied word embedding, first and last stage (lesson 11).
Prints one line per problem and exits 1 if there is any, 0 if there is none, 2 when DIR is not a checkpoint.
"""

import argparse
import os
import sys
from dataclasses import fields

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import checkpoint  # noqa: E402
import parallel  # noqa: E402
import reshard  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def tag_dir_of(directory):
    """directory itself when it is a checkpoint (global_stepN), else the one its `latest` names."""
    name = os.path.basename(os.path.normpath(directory))
    if name.startswith("global_step") and name.endswith(checkpoint.PARTIAL):
        parent = os.path.dirname(os.path.normpath(directory))
        raise ValueError(
            f"{directory} is no checkpoint: {checkpoint.describe_half_finished(parent, [name])}"
        )
    if os.path.exists(os.path.join(directory, checkpoint.MANIFEST)) or os.path.exists(
        checkpoint.model_file(directory, parallel.Grid(world_size=1))
    ):
        return directory
    checkpoint.check_directory(directory)
    tag_dir = checkpoint.latest_dir(directory)
    if tag_dir is None:
        raise ValueError(
            f"{directory} is not a checkpoint (no {checkpoint.MANIFEST}, no model file) and holds none "
            f"(no '{checkpoint.LATEST}' file)"
        )
    return tag_dir


def check_files(tag_dir, topology):
    """Problems with the files: missing, truncated, corrupt (against the manifest)."""
    paths = checkpoint.layout_files(tag_dir, topology)
    manifest = checkpoint.read_manifest(tag_dir)
    if manifest is None:
        print(
            f"note: {tag_dir} has no {checkpoint.MANIFEST} (written by an older version): sizes and checksums "
            "are not checked"
        )
        return [f"{path}: it is missing" for path in paths if not os.path.exists(path)], len(paths)
    problems = [
        f"{path}: {problem}"
        for path in paths
        if (problem := checkpoint.check_file(path, manifest)) is not None
    ]
    names = {os.path.basename(p) for p in paths}
    problems += [
        f"{os.path.join(tag_dir, name)}: listed in the manifest but not a file of a "
        f"{reshard.describe(topology)} checkpoint"
        for name in manifest["files"]
        if name not in names
    ]
    return problems, len(paths)


def check_model(tag_dir, topology):
    """Problems with the model shards: names and shapes against the stored config, TP replicas, tied copies."""
    layout = reshard.SavedLayout(tag_dir, topology)
    config = layout.config
    cfg = GPTConfig(**{f.name: config[f.name] for f in fields(GPTConfig) if f.name in config})
    cfg.tensor_model_parallel_size = layout.tp
    stages = parallel.partition_layers(
        cfg.num_layers, layout.pp, config.get("pp_partition_method", "type:transformer|embedding")
    )
    problems = []
    for pp in range(layout.pp):
        for tp in range(layout.tp):
            g = layout.grid(tp, 0, pp)
            with torch.device("meta"):
                stage = GPT(cfg, stages[pp], g.is_first_stage, g.is_last_stage, grid=g)
            have, where = layout.model(tp, pp)["model"], checkpoint.model_file(tag_dir, g)
            first = layout.model(0, pp)["model"]
            params = dict(stage.named_parameters())
            for name, p in params.items():
                if name not in have:
                    problems.append(
                        f"{where}: {name} is missing (the stored config's model has it)"
                    )
                elif have[name].shape != p.shape:
                    problems.append(
                        f"{where}: {name} has shape {tuple(have[name].shape)}, the stored config's "
                        f"model {tuple(p.shape)}"
                    )
                elif (
                    tp > 0
                    and getattr(p, "tp_dim", None) is None
                    and name in first
                    and not torch.equal(have[name], first[name])
                ):
                    problems.append(
                        f"{where}: {name} differs from TP rank 0's copy (replicated parameters must be "
                        "identical, lesson 18)"
                    )
            problems += [
                f"{where}: {name} is not a parameter of the stored config's model"
                for name in have
                if name not in params
            ]
    # an untied output layer is the last stage's own: no copy of the embedding there
    if layout.pp > 1 and not cfg.untie_embeddings_and_output_weights and not problems:
        for tp in range(layout.tp):
            first, last = layout.model(tp, 0)["model"], layout.model(tp, layout.pp - 1)["model"]
            if not torch.equal(first["embed.word.weight"], last["output_weight"]):
                problems.append(
                    f"{checkpoint.model_file(tag_dir, layout.grid(tp, 0, layout.pp - 1))}: the last "
                    "stage's copy of the tied word embedding differs from the first stage's (lesson 11)"
                )
    return problems


def check(directory):
    """(problems, a one-line summary) of the checkpoint in directory; ValueError when it is not a checkpoint."""
    tag_dir = tag_dir_of(directory)
    topology = checkpoint.saved_topology(tag_dir)
    problems, files = check_files(tag_dir, topology)
    if not problems:  # tensors are read only from files known to be whole
        problems = check_model(tag_dir, topology)
    summary = (
        f"{tag_dir}: {reshard.describe(topology)}, {files} files whole, shapes as the stored config's "
        "model, TP replicas and tied copies equal"
    )
    return problems, summary


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "directory", help="a checkpoint (global_stepN) or a save directory (its 'latest')"
    )
    args = parser.parse_args(argv)
    problems, summary = check(args.directory)
    for problem in problems:
        print(f"FAIL {problem}")
    if problems:
        print(
            f"{len(problems)} problem(s): do not resume from this checkpoint; an earlier global_stepN may be whole "
            "(check it, then write its name into 'latest')"
        )
        return 1
    print(f"OK {summary}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
