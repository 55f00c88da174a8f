"""Compare every rank's weights before a checkpoint save with the same rank's weights right after loading it.

    python tools/compare_weight_dumps.py CHECKPOINT_DIR      # exit 1 if any parameter differs or is missing

Training with dump_weights=True writes CHECKPOINT_DIR/weight_dumps/debug-{iteration}-pp{p}-tp{t}-dp{d}-global{r}-
{before-save|after-load}.pt (checkpoint.dump_weights). For each global rank, the after-load dump of an iteration
is compared with the before-save dump of the same iteration, bit for bit. This is the 176B team's
`diff -u a/debug-805-... b/debug-806-...` over 384 ranks (lesson 11), which showed the last stage's copy of the
word embedding and its LayerNorm coming back different after a reload.
"""

import argparse
import glob
import os
import re
import sys

import torch

DUMP = re.compile(r"debug-(\d+)-pp(\d+)-tp(\d+)-dp(\d+)-global(\d+)-(before-save|after-load)\.pt$")


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "directory", help="the checkpoint directory (save/load) holding weight_dumps/"
    )
    args = parser.parse_args(argv)
    dumps = find_dumps(args.directory)
    loads = sorted((rank, it) for rank, it, what in dumps if what == "after-load")
    if not loads:
        print(
            f"no after-load dumps in {args.directory}: train with dump_weights=True, save, then resume"
        )
        return 1
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
        lines = compare(
            torch.load(before, map_location="cpu"), torch.load(after, map_location="cpu")
        )
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
