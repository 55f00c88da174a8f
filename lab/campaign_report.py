"""The campaign's report (docs/spike_guard.md, section 9, "The campaign"): its records read back and scored,
the tables, the metrics and the figure, and what a registration freezes of the scoring (MEASURED, GOALS, the
thresholds), checked before any record is scored.
"""

import hashlib
import inspect
import json
import math
import os
import re
import sys

import guard_metrics
from campaign_draw import FAMILIES, HARM, SEVENTH, is_harmful

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import files  # noqa: E402

CAUSES = ["data", "optimizer", "hardware", "numerical", "persistent", "none"]
# the methods a campaign runs its trials under, in its tables' order: the guard, doing nothing, then the field's
# remedies (their flags: guard_campaign.REMEDIES)
METHODS = [
    "guard",
    "none",
    "skip_step",
    "spiky_loss",
    "grad_norm_skip",
    "zclip",
    "opt_restart",
    "palm_restart",
]
# detects and never acts (Megatron-LM's spiky-loss check re-runs and reports; its restart is the
# operator's): it is reported as a detector, out of the remedies' table
DETECTORS = ("spiky_loss",)


def cause_of(line):
    # the DP replica check's decisions (replica_check.py) name no cause word: replicas that differ are hardware
    for key, cause in (
        ("persistent fault", "persistent"),
        ("hardware/transient", "hardware"),
        ("the DP replicas differ", "hardware"),
        ("DP replica check:", "hardware"),
        ("take its node out", "hardware"),
        ("numerical: ", "numerical"),
        ("data-driven", "data"),
        ("optimizer-driven", "optimizer"),
    ):
        if key in line:
            return cause
    return "none"


def wilson(k, n, z=1.96):
    """The 95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre, half = (
        (p + z * z / (2 * n)) / (1 + z * z / n),
        z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n),
    )
    return (max(0.0, centre - half), min(1.0, centre + half))


def names(k, method):
    """(the faulted run's name, the clean run's name) of trial k under method: the guard's clean twin is the trial's
    reference for every method; a remedy's clean run is its own."""
    faulted = {"guard": f"{k}-guarded", "none": f"{k}-unguarded"}.get(method, f"{k}-{method}")
    return faulted, f"{k}-clean" if method in ("guard", "none") else f"{k}-clean-{method}"


def source_sha256(functions):
    """The hash of these functions' source, in order: what a registration freezes of the draw's
    and the metrics' code."""
    return hashlib.sha256("".join(inspect.getsource(f) for f in functions).encode()).hexdigest()


def measured(harm):
    """What a registration freezes of how its runs are scored: the metrics' code, the goals and the
    thresholds (a report checks them against its own, check_measured)."""
    return {
        "metrics_sha256": source_sha256(MEASURED),
        "goals": GOALS,
        "harm_threshold": harm,
        "thresholds": {
            "detect_window": guard_metrics.DETECT_WINDOW,
            "loss_cap": guard_metrics.LOSS_CAP,
            "bootstrap": guard_metrics.BOOTSTRAP,
            "calibration": list(guard_metrics.CALIBRATION),
        },
    }


def check_measured(registration, harm):
    """Refuses to report a registration's runs with metrics, goals or thresholds other than the ones
    it froze: a report may come from a later checkout, but it scores the runs as registered."""
    if registration is None or "metrics_sha256" not in registration:
        return  # the sixth's and older registrations froze no metrics
    now = measured(harm)
    changed = [k for k in now if registration.get(k) != now[k]]
    if changed:
        # the lab's modules as a whole: a registration older than the split into campaign_draw.py and
        # campaign_report.py restores guard_campaign.py whole, which then holds every metric
        raise SystemExit(
            f"this checkout scores runs differently from the registration ({', '.join(changed)} "
            f"changed since {registration['commit'][:7]}): report with the registered lab code "
            f"(git checkout {registration['commit'][:7]} -- ':(glob)lab/*.py'), "
            f"and --harm {registration['harm_threshold']}"
        )


# the seventh campaign's goals, frozen with it (a goal is met when its interval, not its estimate,
# is past it)
GOALS = {
    "damage removed (mean share; trials harmful by their loss)": ">= 0.8, the 95% interval above every remedy's mean",
    "trials ending worse than the unremedied twin by more than the harm threshold": "0",
    "replicas equal at the end (trials harmful by their replicas)": ">= 90%",
    "detected within the window, net of the clean-run base rate": ">= 90%",
    "clean runs with an action": "<= 1 in 100",
    "harmless faults stopped": "0",
    "harmful trials per family": ">= 10 (stratified draw; trials added, registered anew, where short)",
}


def registration_id(registration):
    if registration is None:
        return None
    return hashlib.sha256(json.dumps(registration, sort_keys=True).encode()).hexdigest()[:16]


def one_registration(runs, registration=None):
    """Refuses runs of several registrations (or of one and of none) in one report, and runs of another than
    `registration` (the --preregister file) when given."""
    ids = {r.get("registration") for r in runs.values()}
    if len(ids) > 1:
        raise SystemExit(
            f"the runs come from {len(ids)} registrations ({', '.join(map(str, sorted(ids, key=str)))}):"
            " report each campaign from its own --out"
        )
    if registration is not None and ids and ids != {registration_id(registration)}:
        raise SystemExit(
            f"the runs are of registration {ids.pop()}, not of --preregister's "
            f"{registration_id(registration)}"
        )


def runs_of(out):
    runs = {}
    for line in open(os.path.join(out, "runs.jsonl")):
        r = json.loads(line)
        runs[r["name"]] = r
    return runs


def trials_of(out):
    runs, trials = runs_of(out), []
    for k in sorted({r["trial"] for r in runs.values() if "trial" in r}):
        parts = [runs.get(f"{k}-{x}") for x in ("clean", "unguarded", "guarded")]
        if all(parts):
            trials.append(dict(zip(("clean", "unguarded", "guarded"), parts)))
    return trials


def report(out, harm=HARM, registration=None, baselines=None):
    """OUT/report.md (the tables) and OUT/campaign.png (the figure); returns the markdown. Refuses runs of more than
    one registration (one_registration). baselines: another registration's --out (beside_baselines)."""
    runs = runs_of(out)
    one_registration(runs, registration)
    check_measured(registration, harm)
    trials = trials_of(out)
    spent = sum(r.get("seconds", 0) * r.get("nproc", 1) for r in runs.values()) / 3600
    lines = [
        f"{len(trials)} complete trials (3 runs each; false positives: every finished clean run); "
        f"{spent:.1f} CPU-hours of run time (each run's wall time x its processes)",
        "",
    ]
    harmful, detected, right, diagnosed, within, rollbacks = 0, 0, 0, 0, 0, []
    matrix = {t: {c: 0 for c in CAUSES} for t in sorted(set(FAMILIES.values()))}
    # finished, their trial or not
    cleans = [r for name, r in runs.items() if name.endswith("-clean")]
    clean_iters, false_positives, rows = (
        sum(r["iters"] for r in cleans),
        sum(len(r["decisions"]) for r in cleans),
        [],
    )
    for t in trials:
        clean, bad, guarded = t["clean"], t["unguarded"], t["guarded"]
        ratio = bad["valid"] / clean["valid"] if math.isfinite(bad["valid"]) else math.inf
        harmful_here = is_harmful(clean, bad, harm)
        acts = acts_from(guarded, guarded["start"])
        true = SEVENTH[guarded["family"]]
        decided = cause_of(acts[0]) if acts else "none"
        if acts:
            matrix[true][decided] += 1
            diagnosed += 1
            right += decided == true
        g_ratio = guarded["valid"] / clean["valid"] if math.isfinite(guarded["valid"]) else math.inf
        if harmful_here:
            harmful += 1
            detected += bool(acts)
            within += g_ratio <= 1 + harm and not guarded.get("replica_gap")
            rollbacks.append(guarded["rollbacks"])
        rows.append(
            (
                guarded["family"],
                guarded["what"],
                harmful_here,
                decided,
                ratio,
                g_ratio,
                guarded["exit"],
                guarded["rollbacks"],
            )
        )

    def rate(k, n):
        lo, hi = wilson(k, n)
        return f"{k}/{n} = {k / n:.0%} (95% CI {lo:.0%}-{hi:.0%})" if n else "0/0"

    fp_runs = sum(bool(r["decisions"]) for r in cleans)
    fp_lo, fp_hi = wilson(false_positives, clean_iters)
    fp = 1000 * false_positives / max(clean_iters, 1)
    lines += [
        "| measure | goal | measured |",
        "|---|---|---|",
        f"| harmful faults detected | >= 90% | {rate(detected, harmful)} |",
        f"| diagnoses right (of the faults the guard acted on) | >= 85% | {rate(right, diagnosed)} |",
        f"| false positives per 1,000 clean iterations | <= 0.1 | {fp:.2f} ({false_positives} in {clean_iters}; "
        f"95% CI {1000 * fp_lo:.2f}-{1000 * fp_hi:.2f}) |",
        f"| clean runs with a decision (the run as the unit) | <= 1 in 100 | {rate(fp_runs, len(cleans))} |",
        f"| guarded final loss within 1% of the clean twin's (harmful faults) | >= 80% | "
        f"{rate(within, harmful)} |",
        f"| rollbacks per harmful fault | <= 1 | mean {sum(rollbacks) / max(len(rollbacks), 1):.2f}, max "
        f"{max(rollbacks, default=0)} |",
        "",
        "Diagnosis (rows: the true cause; columns: the cause of the guard's first decision at or after the "
        "fault's start):",
        "",
        "| true \\ decided | " + " | ".join(CAUSES) + " |",
        "|---|" + "---|" * len(CAUSES),
    ]
    lines += [f"| {t} | " + " | ".join(str(matrix[t][c]) for c in CAUSES) + " |" for t in matrix]
    lines += [
        "",
        "| fault | harmful | decided | unguarded / clean | guarded / clean | exit | rollbacks |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {w} | {'yes' if h else 'no'} | {d} | {r:.3f} | {g:.3f} | {e} | {rb} |"
        for f, w, h, d, r, g, e, rb in rows
    ]
    if any(r.get("method") not in (None, "guard", "none") for r in runs.values()):
        lines += [
            "",
            "Methods on the same faults (each remedy runs the harmful trials and its own clean runs; the "
            "guard's clean runs are the clean twins):",
            "",
            method_table(runs, harm),
        ]
    lines += [
        "",
        "The primary metric and the costs (lab/guard_metrics.py; a rollback's replays "
        "count as iterations run):",
        "",
        primary_table(runs, harm),
        worse_than_nothing(runs, out, harm),
    ]
    if baselines:
        lines += ["", *beside_baselines(out, baselines, harm)]
    per_family = family_table(runs, harm)
    if per_family:
        lines += ["", per_family]
    no_method = beside_no_method(runs, harm)
    if no_method:
        lines += ["", no_method]
    text = "\n".join(lines) + "\n"
    files.write_text(text, os.path.join(out, "report.md"))
    figure(rows, os.path.join(out, "campaign.png"))
    return text


def acts_from(record, start):
    """The actions of a run at or after the fault's start (each action's line names its iteration)."""
    return [d for d in record["decisions"] if int(re.search(r"iteration (\d+)", d)[1]) >= start]


def right_diagnosis(method, act, family):
    """Whether the method's first action names the fault's cause, where the method says one: the guard's cause;
    Megatron's re-run tells a transient (hardware) fault from a reproducible one (not hardware). None elsewhere."""
    true = SEVENTH[family]
    if method == "guard":
        return cause_of(act) == true
    if method == "spiky_loss":
        return ("not reproducible" in act) == (true == "hardware")
    return None


def rate(k, n):
    lo, hi = wilson(k, n)
    return f"{k}/{n} = {k / n:.0%} ({lo:.0%}-{hi:.0%})" if n else "-"


def method_results(runs, harm=HARM):
    """{method: its numbers} over the trials whose clean twin and unguarded run are in: on the harmful ones, its
    faulted runs (detected, right diagnosis, final validation loss / the clean twin's); its clean runs (runs with
    an action, actions per iteration); per fault class, detected of harmful."""
    ks = sorted(
        {
            r["trial"]
            for r in runs.values()
            if "trial" in r and f"{r['trial']}-clean" in runs and f"{r['trial']}-unguarded" in runs
        }
    )
    harmful = [k for k in ks if is_harmful(runs[f"{k}-clean"], runs[f"{k}-unguarded"], harm)]
    results = {}
    for method in METHODS:
        out = {
            "n": 0,
            "detected": 0,
            "diagnosed": 0,
            "right": 0,
            "within": 0,
            "ratios": [],
            "classes": {},
        }
        for k in harmful:
            run, clean = runs.get(names(k, method)[0]), runs[f"{k}-clean"]
            if run is None:
                continue
            acts = acts_from(run, run["start"])
            ratio = (
                run["valid"] / clean["valid"]
                if math.isfinite(run["valid"]) and run["exit"] == 0
                else math.inf
            )
            right = right_diagnosis(method, acts[0], run["family"]) if acts else None
            within = ratio <= 1 + harm and not run.get("replica_gap")
            cls = out["classes"].setdefault(run["family"], [0, 0, 0])  # detected, harmful, within
            cls[0], cls[1], cls[2] = cls[0] + bool(acts), cls[1] + 1, cls[2] + within
            out["n"], out["detected"] = out["n"] + 1, out["detected"] + bool(acts)
            out["ratios"].append(ratio)
            out["diagnosed"], out["right"] = (
                out["diagnosed"] + (right is not None),
                out["right"] + bool(right),
            )
            out["within"] += within
        cleans = [
            runs[names(k, method)[1]]
            for k in ks
            if names(k, method)[1] in runs and method != "none"
        ]
        cleans += [r for name, r in runs.items() if name.startswith("long") and method == "guard"]
        out["clean_runs"], out["fp_runs"] = len(cleans), sum(bool(r["decisions"]) for r in cleans)
        out["clean_iters"] = sum(r["iters"] for r in cleans)
        out["fp_actions"] = sum(len(r["decisions"]) for r in cleans)
        results[method] = out
    return results


def method_table(runs, harm=HARM):
    """The markdown of methods x (detection, false positives, right diagnosis, damage), then detection per fault
    class, each rate with its 95% Wilson interval."""
    results = method_results(runs, harm)
    lines = [
        f"| method | harmful faults detected | clean runs with an action (false positives) | false positives per "
        f"1,000 clean iterations | right diagnosis | final loss within {harm:.0%} of the clean twin | median "
        "final / clean |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, r in results.items():
        if not r["n"] and not r["clean_runs"]:
            continue
        lo, hi = wilson(r["fp_actions"], r["clean_iters"])
        fp = (
            f"{1000 * r['fp_actions'] / r['clean_iters']:.2f} ({1000 * lo:.2f}-{1000 * hi:.2f})"
            if r["clean_iters"]
            else "-"
        )
        ratios = sorted(r["ratios"])
        median = f"{ratios[len(ratios) // 2]:.3f}" if ratios else "-"
        lines.append(
            f"| {method} | {rate(r['detected'], r['n']) if method != 'none' else '-'} | "
            f"{rate(r['fp_runs'], r['clean_runs'])} | {fp} | {rate(r['right'], r['diagnosed'])} | "
            f"{rate(r['within'], r['n'])} | {median} |"
        )
    shown = [m for m in METHODS if m != "none" and results[m]["n"]]
    classes = sorted({c for m in shown for c in results[m]["classes"]})
    lines += [
        "",
        "Harmful faults detected, per fault class:",
        "",
        "| fault class | " + " | ".join(shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    lines += [
        f"| {c} | "
        + " | ".join(rate(*results[m]["classes"].get(c, (0, 0))[:2]) for m in shown)
        + " |"
        for c in classes
    ]
    # where a remedy beats the guard is a class's damage, not its detection: an action that does not undo the harm
    lines += [
        "",
        f"Harmful faults ending within {harm:.0%} of the clean twin, per fault class:",
        "",
        "| fault class | " + " | ".join(shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    lines += [
        f"| {c} | "
        + " | ".join(
            rate(
                results[m]["classes"].get(c, (0, 0, 0))[2],
                results[m]["classes"].get(c, (0, 0, 0))[1],
            )
            for m in shown
        )
        + " |"
        for c in classes
    ]
    return "\n".join(lines) + "\n"


def primary_results(runs, harm=HARM):
    """{method: its seventh-campaign numbers} over the trials whose clean twin and unremedied run
    are in: the share of the damage removed per trial harmful by its loss; replicas equal where the
    unremedied run's ended apart; detections within the window and the base rate of its clean runs;
    the costs; actions and stops on harmless faults (where the method ran them)."""
    ks = sorted(
        {
            r["trial"]
            for r in runs.values()
            if "trial" in r and f"{r['trial']}-clean" in runs and f"{r['trial']}-unguarded" in runs
        }
    )
    ref = {k: (runs[f"{k}-clean"], runs[f"{k}-unguarded"]) for k in ks}
    harmful = [k for k in ks if is_harmful(*ref[k], harm)]
    results = {}
    for method in METHODS:
        out = {
            "shares": [],
            "apart": 0,
            "rejoined": 0,
            "harmful": 0,
            "detected": 0,
            "costs": [],
            "harmless": 0,
            "harmless_acted": 0,
            "harmless_stopped": 0,
        }
        for k in ks:
            run = runs.get(names(k, method)[0])
            if run is None or method == "none":
                continue
            clean, bad = ref[k]
            out["costs"].append(guard_metrics.costs(run, bad))
            if k not in harmful:
                out["harmless"] += 1
                out["harmless_acted"] += bool(acts_from(run, run["start"]))
                out["harmless_stopped"] += run["exit"] != 0
                continue
            out["harmful"] += 1
            out["detected"] += guard_metrics.acted_within(run, run["start"])
            share = guard_metrics.damage_removed(clean, bad, run)
            if share is not None and is_harmful(clean, {**bad, "replica_gap": None}, harm):
                out["shares"].append(share)
            if bad.get("replica_gap"):
                out["apart"], out["rejoined"] = (
                    out["apart"] + 1,
                    out["rejoined"] + (run.get("replica_gap") == 0),
                )
        cleans = [
            runs[names(k, method)[1]]
            for k in ks
            if names(k, method)[1] in runs and method != "none"
        ]
        cleans += [r for name, r in runs.items() if name.startswith("long") and method == "guard"]
        out["base"] = guard_metrics.base_rate(
            cleans, [runs[f"{k}-unguarded"]["start"] for k in harmful]
        )
        results[method] = out
    return results


def primary_table(runs, harm=HARM):
    """The markdown of methods x (damage removed with its bootstrap interval, trials worse than
    doing nothing, replicas, detection net of the base rate, costs, harmless faults acted on and
    stopped); detectors apart."""
    w = guard_metrics.DETECT_WINDOW
    lines = [
        "| method | damage removed: mean share (95% bootstrap) | worse than doing nothing | "
        "replicas equal where the unremedied ended apart | detected within "
        f"{w} iterations - clean base rate | iterations run | wall time | snapshots held | "
        "harmless faults acted on / stopped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, r in primary_results(runs, harm).items():
        if not r["harmful"] and not r["harmless"]:
            continue
        mean, lo, hi = guard_metrics.bootstrap_mean(r["shares"])
        shares = f"{mean:.2f} ({lo:.2f} to {hi:.2f}), n={len(r['shares'])}" if r["shares"] else "-"
        worse = sum(x < 0 for x in r["shares"])
        net = (
            r["detected"] / r["harmful"] - r["base"]
            if r["harmful"] and math.isfinite(r["base"])
            else math.nan
        )
        steps, wall, held = (sum(c[i] for c in r["costs"]) / len(r["costs"]) for i in range(3))
        name = method + (" (detects, never acts)" if method in DETECTORS else "")
        lines.append(
            f"| {name} | {shares} | {worse} | {r['rejoined']}/{r['apart']} | "
            f"{r['detected']}/{r['harmful']} - {r['base']:.2f} = {net:+.2f} | {steps:+.1%} | "
            f"{wall:+.1%} | "
            f"{held:.1f} | {r['harmless_acted']}/{r['harmless']} / {r['harmless_stopped']}"
            f"/{r['harmless']} |"
        )
    lines += [
        "",
        "Harmful trials per family (the goal: >= 10 each):",
        "",
        "| family | trials | harmful |",
        "|---|---|---|",
    ]
    for family in sorted({r["family"] for r in runs.values() if r.get("family")}):
        ks = {
            r["trial"]
            for r in runs.values()
            if r.get("family") == family
            and f"{r['trial']}-clean" in runs
            and f"{r['trial']}-unguarded" in runs
        }
        bad = sum(is_harmful(runs[f"{k}-clean"], runs[f"{k}-unguarded"], harm) for k in ks)
        lines.append(f"| {family} | {len(ks)} | {bad} |")
    return "\n".join(lines) + "\n"


def family_table(runs, harm=HARM):
    """The primary metric per fault family: each method's mean share of the damage removed (primary_results on
    that family's runs alone) and its n. Beside the registered metrics, not one of them: a mean over every family
    is a mean over the draw's mix of families, and one family's stops (each scored ln 512) can outweigh all the
    others'; this says where. Markdown, or "" where no method but doing nothing has a share."""
    families = sorted({r["family"] for r in runs.values() if r.get("family")})
    shares = {
        f: primary_results({n: r for n, r in runs.items() if r.get("family") == f}, harm)
        for f in families
    }
    shown = [
        m
        for m in METHODS
        if m != "none" and m not in DETECTORS and any(shares[f][m]["shares"] for f in families)
    ]
    if not shown:
        return ""

    def cell(values):
        return f"{sum(values) / len(values):.2f}, n={len(values)}" if values else "-"

    return (
        "\n".join(
            [
                "Damage removed per family (the mean share, as the primary metric, over each family's trials "
                "harmful by their loss; beside the registered metrics, not one of them):",
                "",
                "| family | " + " | ".join(shown) + " |",
                "|---|" + "---|" * len(shown),
                *(
                    f"| {f} | " + " | ".join(cell(shares[f][m]["shares"]) for m in shown) + " |"
                    for f in families
                ),
            ]
        )
        + "\n"
    )


def same_run(a, b):
    """Two records of one run to every recorded digit: exit, final loss, every logged loss and grad norm."""
    return (a["exit"], repr(a["valid"]), a["series"]) == (b["exit"], repr(b["valid"]), b["series"])


def beside_no_method(runs, harm=HARM):
    """The guard's clean twins beside the same runs with no method: a detector's clean runs (DETECTORS: it never
    acts, so its clean run of trial k is trial k's clean run with no method). Beside the registered metrics, not
    one of them: the registered scoring takes the guard's clean run as every method's reference, and where the
    guard acted on it that reference is not doing nothing (docs/spike_guard.md, "At 10M, the clean twin is not
    doing nothing"). Per trial where the two differ: the guard's decisions, both final losses, and the unremedied
    run against each, and where the fault is harmful by the registered rule (is_harmful) against the twin and not
    against doing nothing. Markdown, or "" where no trial has both runs."""
    pairs = sorted(
        (r["trial"], runs[f"{r['trial']}-clean"], r)
        for n, r in runs.items()
        if any(n.endswith(f"-clean-{d}") for d in DETECTORS) and f"{r['trial']}-clean" in runs
    )
    if not pairs:
        return ""
    differ = [(k, twin, none) for k, twin, none in pairs if not same_run(twin, none)]
    fl = guard_metrics.final_loss

    def over(a, b):
        return fl(a) / fl(b) - 1

    rows = []
    for k, twin, none in differ:
        bad = runs.get(f"{k}-unguarded")
        against = (
            "-"
            if bad is None
            else f"{over(bad, twin):+.2%} / {over(bad, none):+.2%}"
            + (
                " (harmful by the rule, not against doing nothing)"
                if is_harmful(twin, bad, harm) and not is_harmful(none, bad, harm)
                else ""
            )
        )
        rows.append(
            f"| {k} | {twin['family']} | {len(twin['decisions'])} | {fl(twin):.4f} | {fl(none):.4f} | "
            f"{over(twin, none):+.2%} | {against} |"
        )
    acted = sum(bool(twin["decisions"]) for _, twin, _ in pairs)
    head = (
        f"The guard's clean twins beside the same runs with no method (the clean runs of {', '.join(DETECTORS)}, "
        f"which never acts; beside the registered metrics, not one of them): {len(pairs)} trials, the guard acted "
        f"on {acted} of its clean twins, {len(pairs) - len(differ)} the same to every recorded digit"
    )
    if not differ:
        return head + ".\n"
    return (
        "\n".join(
            [
                head + "; where they differ:",
                "",
                "| trial | family | the guard's decisions on its clean twin | clean twin (guarded) | no method | "
                "twin / no method | unremedied / twin, / no method |",
                "|---|---|---|---|---|---|---|",
                *rows,
            ]
        )
        + "\n"
    )


def same_twins(mine, theirs):
    """Trial numbers whose clean and unremedied runs are in both records and agree to every recorded
    digit (exit, final loss, every logged loss and grad norm): the runs the two registrations share."""
    ks = {r["trial"] for r in mine.values() if "trial" in r}
    return sorted(
        k
        for k in ks
        if all(
            f"{k}-{x}" in mine
            and f"{k}-{x}" in theirs
            and same_run(mine[f"{k}-{x}"], theirs[f"{k}-{x}"])
            for x in ("clean", "unguarded")
        )
    )


def with_baselines(mine, theirs):
    """(the trials whose twins agree in both records: same_twins; this registration's runs of those
    trials and its untrialled runs, with the other's remedy runs of the same trials)."""
    agree = same_twins(mine, theirs)
    merged = {n: r for n, r in mine.items() if r.get("trial") in agree or "trial" not in r}
    merged.update(
        (n, r)
        for n, r in theirs.items()
        if r.get("trial") in agree and r.get("method") not in (None, "guard", "none")
    )
    return agree, merged


def beside_baselines(out, baselines, harm=HARM):
    """The primary table of this registration's guard beside another registration's remedy runs of the
    same trials (the eighth's guard, the seventh's remedies), on the trials whose twins both hold and
    agree to every digit (same_twins); each registration's records checked against its own file
    (BASELINES/registration.json), metrics included. Markdown lines."""
    theirs_file = os.path.join(baselines, "registration.json")
    theirs_reg = json.load(open(theirs_file)) if os.path.exists(theirs_file) else None
    mine, theirs = runs_of(out), runs_of(baselines)
    one_registration(theirs, theirs_reg)
    check_measured(theirs_reg, harm)
    agree, merged = with_baselines(mine, theirs)
    ks = sorted({r["trial"] for r in mine.values() if "trial" in r})
    apart = [k for k in ks if k not in agree]
    return [
        f"Beside the remedies of {baselines} (registration {registration_id(theirs_reg)}): "
        f"{len(agree)} of {len(ks)} trials, whose clean and unremedied runs agree to every recorded "
        "digit in both registrations"
        + (f"; apart (no baseline): {', '.join(map(str, apart))}" if apart else "")
        + ":",
        "",
        primary_table(merged, harm),
    ]


def ending(out, record):
    """How a run ended, in words: finished, stopped by the guard (its stop line names the cause;
    torchrun turns a worker's exit 3 into its own 1), or died. The stop line is read from the run's
    log where it is kept (OUT/logs, not committed); from the record alone, the last action's cause."""
    if record.get("requeued"):
        r = record["requeued"]
        then = "finished" if record["exit"] == 0 else f"failed again (exit {record['exit']})"
        return (
            f"stopped by the guard at iteration {r['iteration']}, {r['cause']}; requeued without DP rank "
            f"{r['dp_rank']}'s device, {then}"
        )
    if record["exit"] == 0:
        return "finished"
    log = os.path.join(out, "logs", f"{record['name']}.log")
    if os.path.exists(log):
        lines = open(log, errors="replace").read().splitlines()
        stops = [x for x in lines if x.startswith("error: spike guard: iteration")]
        if stops:
            it = re.match(r"error: spike guard: iteration (\d+)", stops[-1])[1]
            return f"stopped by the guard at iteration {it}, {cause_of(stops[-1])} (exit {record['exit']})"
        errors = [x for x in lines if re.match(r"\w*(Error|error)\b", x)]
        return f"died (exit {record['exit']}): {errors[-1][:80] if errors else 'no error line'}"
    last = cause_of(record["decisions"][-1]) if record["decisions"] else "none"
    return f"exit {record['exit']}, its last action's cause {last} (no log)"


def worse_than_nothing(runs, out, harm=HARM):
    """The markdown list of every trial in which a method ended measurably worse than doing nothing:
    its final loss (a run that did not finish scored as LOSS_CAP) more than `harm` over the
    unremedied twin's, or its DP replicas apart where the unremedied run's ended equal; with how it
    ended. Beside the registered metrics, not one of them: it names where, the table counts."""
    ks = sorted(
        {
            r["trial"]
            for r in runs.values()
            if "trial" in r and f"{r['trial']}-clean" in runs and f"{r['trial']}-unguarded" in runs
        }
    )
    rows = []
    for method in [m for m in METHODS if m != "none"]:
        for k in ks:
            run, bad = runs.get(names(k, method)[0]), runs[f"{k}-unguarded"]
            if run is None:
                continue
            mine, theirs = guard_metrics.final_loss(run), guard_metrics.final_loss(bad)
            apart = bool(run.get("replica_gap")) and not bad.get("replica_gap")
            if mine > theirs * (1 + harm) or apart:
                rows.append(
                    f"| {method} | {k} | {run['family']} | {theirs:.4f} | {mine:.4f} | "
                    f"{'apart' if apart else 'equal' if run.get('replica_gap') == 0 else '-'} | "
                    f"{ending(out, run)} |"
                )
    head = [
        f"Trials in which a method ended more than {harm:.0%} worse than doing nothing (final loss; "
        f"a run that did not finish scored as ln(512) = {guard_metrics.LOSS_CAP:.4f}), or with its "
        "replicas apart where doing nothing kept them equal:",
        "",
        "| method | trial | family | unremedied final loss | its final loss | replicas | how it ended |",
        "|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + (rows or ["| none | | | | | | |"])) + "\n"


# the code a registration hashes as its metrics
MEASURED = (
    is_harmful,
    acts_from,
    primary_results,
    primary_table,
    guard_metrics.final_loss,
    guard_metrics.damage_removed,
    guard_metrics.bootstrap_mean,
    guard_metrics.acted_within,
    guard_metrics.base_rate,
    guard_metrics.percentile,
    guard_metrics.calibrated_bound,
    guard_metrics.costs,
)


def figure(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, (_, _, harmful, _, ratio, g_ratio, _, _) in enumerate(rows):
        clip = lambda v: min(v, 1.5) if math.isfinite(v) else 1.5  # noqa: E731 (a diverged run drawn at the top)
        ax.plot([k, k], [clip(ratio), clip(g_ratio)], color="0.8", zorder=1)
        ax.scatter([k], [clip(ratio)], marker="x", color="tab:red" if harmful else "0.5", zorder=2)
        ax.scatter(
            [k], [clip(g_ratio)], marker="o", facecolors="none", edgecolors="tab:blue", zorder=3
        )
    ax.axhline(1.01, color="k", lw=0.5, ls="--")
    ax.set_xlabel("trial (x: unguarded, red if harmful; o: guarded)")
    ax.set_ylabel("final validation loss / clean twin's (clipped at 1.5)")
    fig.tight_layout()
    with files.replaced(path) as tmp:
        fig.savefig(tmp, dpi=100)
