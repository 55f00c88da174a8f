"""DESIGN numbers for the guard's next change, read from the fourth and fifth campaigns' records only (issue 41;
docs/spike_guard.md, section 9): no run, no registration. Re-runnable:

    python lab/design_sixth.py              # every decision of every clean run and harmful trial, then the rules
    python lab/design_sixth.py --all        # every guarded trial's decisions, harmful or not

For each guard run of lab/campaign/{fourth,fourth-design,fifth}/runs.jsonl (the fourth's registered runs, the fourth's
re-runs on the changed guard, the fifth's registered runs) it lists each decision of a clean twin (a false positive)
and of a harmful trial's guarded run, with the rule that detected it, its diagnosis, its action, and the step's loss
and grad norm against their trends. The trends are recomputed from the record's series with the detector's own
Series (window 20, judging from 10 steps: the campaign's GUARD flags), skipped steps left out and a rollback
restoring the state of the iteration before its first replayed one; a re-base (a regime change) is not replayed, so
the numbers after one are approximate. Then each candidate rule is counted: the false positives it removes (clean
runs) and the harmful trials whose detection it would change. A harmful trial's later decisions depend on the
earlier ones, which a rule changes: where a rule removes a trial's first decision, what would have followed cannot be
known from the records, so the trial counts as a possible loss (and a sure one when the rule removes all its
decisions). These are design numbers: the records were studied to choose the rule; held-out ones need a new campaign.
"""

import argparse
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import campaign_draw as cd  # noqa: E402
import campaign_report as cr  # noqa: E402
from stability.detector import LEARNT, Series  # noqa: E402

CAMPAIGNS = ["fourth", "fourth-design", "fifth"]
WINDOW, MIN_STEPS = 20, 10  # the campaign's GUARD flags (guard_campaign.GUARD)
# the families run in half precision (the fp32 replay's diagnosis: numerical)
HALF = ("bf16", "fp16")

RULES = [  # (the detection rule, the words that begin its reason)
    ("replica check", "the DP replicas differ"),
    ("replicas disagreed", "hardware/transient fault on DP rank \\d+: DP rank"),
    ("move per update", "at the snapshot: the weights moved"),
    ("learnt by heart", None),
    ("joint", None),
    ("rise", "loss rose"),
    ("grad norm only (no trend)", "grad norm \\S+ is \\S+x clip_grad"),
    ("loss and grad norm", "loss \\S+ is \\S+x its trend's \\S+, \\S+ spreads above it; grad norm"),
    ("loss", "loss \\S+ is \\S+x its trend's"),
    ("grad norm only", "grad norm \\S+ is \\S+x its trend's"),
    ("nan", "the loss is"),
]


def rule_of(head):
    if LEARNT in head:
        return "learnt by heart"
    if re.match(
        r"loss \S+ is \S+x its trend's \S+, \S+ spreads (above|below) it, with grad norm", head
    ):
        return "joint"
    for name, words in RULES:
        if words and re.match(words, head):
            return name
    return "other (replay-first: " + head[:40] + ")"


def action_of(line):
    if any(
        w in line
        for w in (
            "would exceed",
            "a persistent numerical fault",
            "take its node out",
            "more than spike_guard_max_skipped_iters",
        )
    ):
        return "stop"
    if "roll back to before" in line:
        return "rollback"
    if "update skipped" in line or "no update" in line:
        return "skip"
    return "retry"


def lr_cut(line):
    """The LR factor a rollback set, or None."""
    found = re.search(r"LR x(\S+) from now on", line)
    return float(found[1]) if found else None


def walk(series):
    """[(row, the trends' states before it)] in the record's order: each row judged against the loss and grad-norm
    Series of the applied rows before it (a rollback restores those of the iteration before its first replayed
    row)."""
    trends, saved, last, out = fresh(), {}, 0, []
    for row in series:
        it, loss, grad_norm, skips = row[:4]
        if it <= last:  # a rollback: the state of iteration it - 1
            before = [k for k in saved if k < it]
            trends = fresh(saved[max(before)]) if before else fresh()
        states = tuple(t.state() for t in trends)
        out.append((row, states))
        if not skips and math.isfinite(loss) and math.isfinite(grad_norm):
            trends[0].record(loss)
            trends[1].record(grad_norm)
            states = tuple(t.state() for t in trends)
        saved[it], last = states, it
    return out


def fresh(states=(None, None)):
    """The detector's loss and grad-norm Series, from their states (Series.state) or empty."""
    trends = (Series(WINDOW), Series(WINDOW, log=True))
    for series, state in zip(trends, states):
        if state is not None:
            series.load(state)
    return trends


def numbers_of(line):
    """The step's loss and grad norm as the decision line gives them (its replay's, or DP rank 0's), or None."""
    found = re.search(r"replayed: loss (\S+), grad norm ([^,;\s]+)", line) or re.search(
        r"DP rank 0 loss (\S+), grad norm ([^,;\s]+)", line
    )
    return (float(found[1]), float(found[2])) if found else None


def judged(states, loss, grad_norm):
    trends = fresh(states)
    if len(trends[0].values) < MIN_STEPS:
        return "-"
    (lz, lr), (gz, gr) = trends[0].judge(loss), trends[1].judge(grad_norm)
    return f"loss {loss:.4g} {lr:.2f}x ({lz:+.1f} sc), grad norm {grad_norm:.4g} {gr:.3g}x ({gz:+.1f} sc)"


def decisions_of(run):
    """Each decision: its iteration, rule, cause, action, LR cut, and the step's signals against its trends."""
    walked, pos, out = walk(run["series"]), 0, []
    for line in run["decisions"]:
        it = int(re.match(r"spike guard: iteration (\d+): ", line)[1])
        head = line.split(": ", 2)[2]
        # the row of this iteration in the pass of this decision (a rollback's row may be missing from the log)
        k = pos
        while (
            k < len(walked)
            and walked[k][0][0] < it
            and (k == pos or walked[k][0][0] > walked[k - 1][0][0])
        ):
            k += 1
        row, trends = walked[min(k, len(walked) - 1)]
        numbers = (row[1], row[2]) if row[0] == it else numbers_of(line)
        pos = k if row[0] == it else pos
        out.append(
            {
                "iteration": it,
                "rule": rule_of(head),
                "cause": cr.cause_of(line),
                "action": action_of(line),
                "lr": lr_cut(line),
                "signals": judged(trends, *numbers) if numbers else "-",
                "line": line,
            }
        )
    return out


def load(campaign):
    runs = cr.runs_of(os.path.join(HERE, "campaign", campaign))
    return {name: r for name, r in runs.items() if r.get("method") == "guard"}


def reference(campaign):
    """The runs that judge harm: the campaign's own clean twins and unguarded runs (fourth-design: the fourth's)."""
    return cr.runs_of(
        os.path.join(HERE, "campaign", "fourth" if campaign == "fourth-design" else campaign)
    )


def trials(campaign):
    """[(name, run, kind)]: kind clean (a clean twin: any decision is a false positive) or harmful / harmless."""
    runs, ref, out = load(campaign), reference(campaign), []
    for name, run in sorted(runs.items(), key=lambda kv: (kv[1].get("trial", -1), kv[0])):
        k = run.get("trial")
        if name.endswith("-clean"):
            out.append((name, run, "clean"))
        elif name.endswith("-guarded") and f"{k}-clean" in ref and f"{k}-unguarded" in ref:
            harmful = cd.is_harmful(ref[f"{k}-clean"], ref[f"{k}-unguarded"])
            out.append((name, run, "harmful" if harmful else "harmless"))
    return out


def grad_norm_only(d):
    """Candidate 1: an outlier seen only in the grad norm (the loss ordinary), which clip_grad bounds."""
    return d["rule"] in ("grad norm only", "grad norm only (no trend)")


def grad_norm_only_data(d):
    """Candidate 1, narrowed: a grad-norm-only outlier whose diagnosis is data (replayed and reproduced, weights
    sound, not a half-precision fault, the unseen batch ordinary): the update applied, clipped, and no strike."""
    return grad_norm_only(d) and d["cause"] == "data"


def ordinary_move_optimizer(d):
    """Candidate 3: a loss spike's optimizer rollback whose LR cut is the full spike_guard_lr_factor (0.5): the weights'
    move per update since the snapshot was at most 2x its trend, or not measured (the fourth's guard)."""
    return (
        d["action"] == "rollback"
        and d["cause"] == "optimizer"
        and d["rule"] != "move per update"
        and d["lr"] is not None
        and "x0.5: the move per update" in d["line"]
    )


CANDIDATES = {
    "1: no action on a grad-norm-only outlier under clip_grad": grad_norm_only,
    "1': the same, only where the diagnosis is data": grad_norm_only_data,
    "3: no optimizer rollback where the move per update was ordinary": ordinary_move_optimizer,
}


def lr_cut_runs(decisions):
    """Candidate 2 (an LR cut that expires) changes only what follows a cut: the decisions that cut the LR."""
    return [d for d in decisions if d["lr"] is not None and d["lr"] < 1]


def count(rows):
    """{candidate: {"fp removed": [runs], "fp runs": n, "lost": [trials], "possible": [trials]}} and candidate 2's."""
    out = {name: {"removed": [], "lost": [], "possible": [], "harmless": []} for name in CANDIDATES}
    cuts = {"clean": [], "harmful": [], "factors": []}
    for campaign, name, run, kind, decisions in rows:
        tag = f"{campaign} {name} ({run['family']}, {run.get('model')})"
        cuts["factors"] += [
            (d["lr"], tag)
            for d in decisions
            if kind != "clean"
            and d["cause"] == "optimizer"
            and d["action"] == "rollback"
            and d["lr"] is not None
            and (
                "the move per update back to its trend" in d["line"]
                or d["rule"] == "move per update"
            )
        ]
        if kind in ("clean", "harmful") and lr_cut_runs(decisions):
            cuts[kind].append(tag)
        for cand, rule in CANDIDATES.items():
            hit = [rule(d) for d in decisions]
            if kind == "clean" and decisions and all(hit):
                out[cand]["removed"].append(tag)
            acts = [h for d, h in zip(decisions, hit) if d["iteration"] >= run["start"]]
            if kind == "harmful" and acts and acts[0]:
                out[cand]["lost" if all(acts) else "possible"].append(tag)
            if kind == "harmless" and acts and acts[0]:
                out[cand]["harmless"].append(tag + (" all" if all(acts) else " the first"))
    return out, cuts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--all", action="store_true", help="list harmless trials' decisions too")
    a = p.parse_args(argv)
    rows = []
    for campaign in CAMPAIGNS:
        for name, run, kind in trials(campaign):
            rows.append((campaign, name, run, kind, decisions_of(run)))
    print("# Every decision (clean twins: false positives; harmful trials' guarded runs)\n")
    for campaign, name, run, kind, decisions in rows:
        if not decisions or (kind == "harmless" and not a.all):
            continue
        print(
            f"{campaign} {name} [{kind}] {run['what']} ({run.get('model')}, {run.get('nproc')} proc): "
            f"{len(decisions)} decisions"
        )
        for d in decisions:
            cut = f", LR x{d['lr']:g}" if d["lr"] is not None else ""
            print(
                f"  {d['iteration']:>4} {d['rule']:<26} {d['cause']:<10} {d['action']}{cut}: {d['signals']}"
            )
    out, cuts = count(rows)
    print("\n# The candidates (DESIGN numbers: these records chose them)\n")
    for campaign in CAMPAIGNS:
        cleans = [r for r in rows if r[0] == campaign and r[3] == "clean"]
        harmful = [r for r in rows if r[0] == campaign and r[3] == "harmful"]
        detected = sum(any(d["iteration"] >= r[2]["start"] for d in r[4]) for r in harmful)
        print(
            f"{campaign}: {sum(bool(r[4]) for r in cleans)}/{len(cleans)} clean runs with a decision, "
            f"{len(harmful)} harmful trials ({detected} detected)"
        )
    for cand, found in out.items():
        print(f"\ncandidate {cand}")
        print(
            f"  clean runs with a decision removed: {len(found['removed'])}: {'; '.join(found['removed']) or '-'}"
        )
        print(
            f"  harmful detections lost (every decision removed): {len(found['lost'])}: "
            f"{'; '.join(found['lost']) or '-'}"
        )
        print(
            f"  harmful detections possibly lost (the first removed, later ones unknowable): "
            f"{len(found['possible'])}: {'; '.join(found['possible']) or '-'}"
        )
        print(
            f"  harmless faults whose first detection it removes (right detections, no harm to undo): "
            f"{len(found['harmless'])}: {'; '.join(found['harmless']) or '-'}"
        )
    factor, tag = max(cuts["factors"])
    print(
        f"  the LR factors of the fault trials' optimizer rollbacks that cut the LR ({len(cuts['factors'])}): the "
        f"largest x{factor:.3g} ({tag}): the weights' move per update {1 / factor:.1f}x its trend or more, where a "
        "cut of the full x0.5 says at most 2x"
    )
    print(
        "\ncandidate 2: an LR cut that expires. It removes no decision (a clean run keeps its rollback); it changes "
        "only what follows a cut, which no record shows:"
    )
    print(f"  clean runs with an LR cut: {len(cuts['clean'])}: {'; '.join(cuts['clean']) or '-'}")
    print(
        f"  harmful trials with an LR cut (each a possible loss): {len(cuts['harmful'])}: "
        f"{'; '.join(cuts['harmful']) or '-'}"
    )


if __name__ == "__main__":
    main()
