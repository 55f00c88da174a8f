"""Compare every rank's weights before a checkpoint save with the same rank's weights right after loading it.

    python tools/compare_weight_dumps.py CHECKPOINT_DIR

Training with dump_weights=True writes CHECKPOINT_DIR/weight_dumps/debug-{iteration}-pp{p}-tp{t}-dp{d}-global{r}-
{before-save|after-load}.pt (checkpoint.dump_weights). For each global rank, the after-load dump of an iteration
is compared with the before-save dump of the same iteration, bit for bit. This is the 176B team's
`diff -u a/debug-805-... b/debug-806-...` over 384 ranks (lesson 11), which showed the last stage's copy of the
word embedding and its LayerNorm coming back different after a reload.

Exit status (EXIT_CODES, in --help too): 0 identical, 1 a difference, 2 bad input.
"""

import argparse
import glob
import os
import re
import sys

import torch

DUMP = re.compile(r"debug-(\d+)-pp(\d+)-tp(\d+)-dp(\d+)-global(\d+)-(before-save|after-load)\.pt$")
EXIT_CODES = """exit status: 0 every rank's weights identical across save and load; 1 a parameter differs or
is missing, or an after-load dump has no before-save dump; 2 nothing to compare (no such directory,
no after-load dumps) or a dump that cannot be read"""


def find_dumps(directory):
    """{(global rank, iteration, preamble): path}"""
    root = (
        os.path.join(directory, "weight_dumps")
        if os.path.isdir(os.path.join(directory, "weight_dumps"))
        else directory
    )
    dumps = {}
    for path in glob.glob(os.path.join(root, "debug-*.pt")):
        m = DUMP.search(os.path.basename(path))
        if m:
            dumps[(int(m.group(5)), int(m.group(1)), m.group(6))] = path
    return dumps


def compare(before, after):
    """Lines describing every difference between two name -> tensor dicts (empty when identical)."""
    lines = []
    for name in sorted(before.keys() | after.keys()):
        if name not in after:
            lines.append(f"  {name}: missing after load")
        elif name not in before:
            lines.append(f"  {name}: missing before save")
        else:
            a, b = before[name], after[name]
            if a.shape != b.shape or a.dtype != b.dtype:
                lines.append(
                    f"  {name}: {tuple(a.shape)} {a.dtype} before save, {tuple(b.shape)} {b.dtype} after load"
                )
            elif not torch.equal(a, b):
                diff = (a.double() - b.double()).abs()
                lines.append(
                    f"  {name}: {int((a != b).sum())} of {a.numel()} values differ, max |diff| "
                    f"{diff.max().item():.3e} (before save mean {a.double().mean().item():.6e}, after "
                    f"load {b.double().mean().item():.6e})"
                )
    return lines


class Unreadable(Exception):
    """A dump torch.load cannot read (cut short by a kill while it was written, or not a dump)."""


def read(path):
    try:
        return torch.load(path, map_location="cpu")
    except Exception as e:  # torch.load's errors for a damaged file are of many kinds
        said = str(e).split(". ")[0] if str(e) else type(e).__name__  # torch adds advice
        raise Unreadable(
            f"{path} cannot be read ({said}): a dump cut short, or not one; remove it or dump again"
        ) from None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=EXIT_CODES)
    parser.add_argument(
        "directory", help="the checkpoint directory (save/load) holding weight_dumps/"
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        what = "is a file" if os.path.exists(args.directory) else "does not exist"
        print(
            f"error: {args.directory} {what}: give the checkpoint directory of a run trained with "
            "dump_weights=True",
            file=sys.stderr,
        )
        return 2
    dumps = find_dumps(args.directory)
    loads = sorted((rank, it) for rank, it, what in dumps if what == "after-load")
    if not loads:
        print(
            f"error: no after-load dumps in {args.directory}: train with dump_weights=True, save, "
            "then resume",
            file=sys.stderr,
        )
        return 2
    try:
        return compare_all(dumps, loads)
    except Unreadable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def compare_all(dumps, loads):
    """Print each rank's comparison and the count; 1 when any differs, else 0."""
    bad = 0
    for rank, it in loads:
        after = dumps[(rank, it, "after-load")]
        before = dumps.get((rank, it, "before-save"))
        if before is None:
            print(
                f"global rank {rank}, iteration {it}: no before-save dump to compare {os.path.basename(after)} with"
            )
            bad += 1
            continue
        lines = compare(read(before), read(after))
        name = os.path.basename(after)[: -len("-after-load.pt")]
        if lines:
            bad += 1
            print(f"{name}: {len(lines)} parameter(s) differ between save and load")
            print("\n".join(lines))
        else:
            print(f"{name}: identical")
    print(f"{len(loads) - bad} of {len(loads)} rank(s) identical across save/load")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
