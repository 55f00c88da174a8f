"""The stability lab's study as it runs (lab/lr_sweep.py's docstring has the whole of it): the model every run
trains, the arms and their lever sets, where a run lives and the arguments it trains with, and the preflight that
refuses a study which cannot show anything. A run records its arguments, so a change here is a change of the runs
(lr_sweep refuses to resume or read a run under other arguments).
"""

import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bpe_corpus  # noqa: E402

WIDTH = 128


HEAD_DIM = 32  # the study's 4 heads of 32; the ladder keeps the head size (width_args)


DATA = [
    "--data_path=data/lab/" + bpe_corpus.NAME,
    "--tokenizer_file=data/lab/tokenizer.json",
    f"--vocab_size={bpe_corpus.VOCAB_SIZE}",
]


# Every run: the model, Wortsman et al.'s optimizer and schedule scaled down, the telemetry. 16 x 128 tokens an
# iteration (one micro-batch: its logits are 4 MB), 1,000 iterations = 2M tokens, 80% of an epoch; about 0.28 s
# of one core an iteration. 100 iterations of warm-up, then cosine decay to 1e-5 as theirs: with a constant LR,
# or with 500 iterations, the pilot's default at LR 1e-2 ended within 0.2 nats of the bigram entropy
# (lab/stability.md). The levers of the defaults below are set explicitly (config/tiny.py turns some on).
BASE = [
    "--num_layers=4",
    f"--hidden_size={WIDTH}",
    "--num_attention_heads=4",
    "--seq_length=128",
    "--micro_batch_size=16",
    "--global_batch_size=16",
    "--train_iters=1000",
    "--lr_warmup_samples=1600",
    "--lr_decay_style=cosine",
    "--lr_decay_samples=16000",
    "--min_lr=1e-5",
    "--hidden_dropout=0",
    "--attention_dropout=0",
    "--init_method_std=0.02",
    "--embed_layernorm=false",
    "--adam_beta1=0.9",
    "--adam_beta2=0.95",
    "--adam_eps=1e-8",
    "--weight_decay=1e-4",
    "--weight_decay_independent",
    "--clip_grad=1.0",
    "--log_interval=1",
    "--eval_interval=1000000",
    "--eval_iters=16",
    "--sample_tokens=0",
    "--save_interval=100",
    "--telemetry_interval=10",
    *DATA,
]


VOCAB_SIZE = bpe_corpus.VOCAB_SIZE


def init(c):
    """The init std c / sqrt(h): the 104B's 0.02 is 2.15/sqrt(h) at its h = 11,600, "small init" sqrt(2/5h) is
    0.63/sqrt(h) at any width (lesson 3); at this width 0.02 itself would be 0.23/sqrt(h)."""
    return f"--init_method_std={c / math.sqrt(WIDTH):.6g}"


Z_LOSS, QK = ["--z_loss=1e-4"], ["--qk_layernorm"]


HALF_DECADES = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0]


# Each arm: its lever sets (arguments on top of BASE and the arm's own), its LR grid, its seeds (and more seeds at
# some LRs: {lr: seeds}).
ARMS = {
    "A": {
        "title": "qk-layernorm, z-loss 1e-4 on both (Wortsman et al. figs. 1-2)",
        "args": [],
        "levers": {"default": Z_LOSS, "qk_layernorm": [*Z_LOSS, *QK]},
        "lrs": HALF_DECADES,
        "seeds": [1, 2, 3],
        "logit_blows_up": False,
    },
    # as the paper ran it: an output layer of its own (a tied one would be the embedding, held by the inputs' use),
    # with no weight decay, which would hold its logits where the z-loss is under test
    "B": {
        "title": "z-loss, qk-layernorm on both, an untied output layer, no weight decay (figs. 3-4)",
        "args": ["--weight_decay=0", "--untie_embeddings_and_output_weights", *QK],
        "levers": {
            "no_z_loss": [],
            "z_loss": Z_LOSS,
            "z_loss_1e-2": ["--z_loss=1e-2"],
        },  # PaLM's, and 100x
        "lrs": [1e-2, 1e-1, 1.0],
        "seeds": [1, 2],
    },
    "C": {
        "title": "the chronicles' levers on arm A's default (z-loss 1e-4) where it breaks",
        "args": Z_LOSS,
        "levers": {
            "init_2.15": [init(2.15)],
            "init_0.63": [init(0.63)],
            "init_2.15+embed_layernorm": [init(2.15), "--embed_layernorm"],
            "init_0.63+embed_layernorm": [init(0.63), "--embed_layernorm"],
        },
        "lrs": [1e-2, 3e-2, 1e-1],
        "seeds": [1, 2, 3],
        "logit_blows_up": False,
    },
    # The 104B's longer warm-up (lesson 4: it did not cure the spikes) and Wortsman et al.'s warm-up figure (a longer
    # one lowers the LR sensitivity): arm A's default, no qk-layernorm as on the 104B. Its 100-iteration lever set
    # is arm A's default itself ("same_as": the same arguments, so the same runs, run and recorded once).
    "W": {
        "title": "warm-up length on arm A's default (z-loss 1e-4): 100 against 300 of the 1,000 iterations",
        "args": Z_LOSS,
        "levers": {"warmup_100": [], "warmup_300": [f"--lr_warmup_samples={300 * 16}"]},
        "same_as": {"warmup_100": ("A", "default")},
        "lrs": HALF_DECADES,
        "seeds": [1, 2, 3],
        "logit_blows_up": False,
    },
}


# The natural instabilities (issue 50): the 104B's kind -- a too-high LR, no qk-layernorm, a short warm-up, fp16 --
# met by the remedies, each at its published defaults (none scaled to the run), with qk-layernorm as the
# prevention to compare against. The automated checkpoint restarts go back to the runs' own
# checkpoints (every 100 iterations, BASE's save_interval): OPT's with the LR x0.25 from there,
# PaLM's skipping 200 batches from a checkpoint 100 or more before the spike
# (stability/remedies.py; lab/natural.md, the registration).
REMEDIES = {
    "none": [],
    "guard": ["--spike_guard"],
    "skip_step": ["--skip_step_sigma=6"],
    "zclip": ["--zclip_z=2.5"],
    "qk_layernorm": QK,
    "opt_restart": ["--opt_restart_lr_factor=0.25"],
    "palm_restart": ["--palm_restart_skip=200"],
}


# 10 iterations: the edge comes in reach, as on the 104B
SHORT_WARMUP = [f"--lr_warmup_samples={10 * 16}"]


ARMS.update(
    {
        "N": {
            "title": "natural instabilities, fp32: arm A's default (z-loss 1e-4), a 10-iteration warm-up; the "
            "remedies at their published defaults, qk-layernorm the prevention",
            "args": [*Z_LOSS, *SHORT_WARMUP],
            "levers": REMEDIES,
            "lrs": [3e-3, 1e-2, 3e-2, 1e-1],
            "seeds": [1, 2, 3],
            "logit_blows_up": False,
            "remedies": True,
            "short_warmup": "the instabilities under test are the warm-up's and the LR's own",
        },
        "F": {
            "title": "natural instabilities, fp16 with dynamic loss scaling: arm N's runs in Megatron's fp16",
            "args": [*Z_LOSS, *SHORT_WARMUP, "--fp16"],
            "levers": REMEDIES,
            "lrs": [3e-3, 1e-2, 3e-2, 1e-1],
            "seeds": [1, 2, 3],
            "logit_blows_up": False,
            "remedies": True,
            "reference": "N",  # prediction 6: arm F run by run against arm N's fp32 runs
            "widths": [
                64
            ],  # fp16 on a CPU: 5.3 s an iteration against fp32's 0.86 (width 64, loaded, n = 1)
            "short_warmup": "the instabilities under test are the warm-up's and the LR's own",
        },
    }
)


PILOT = [("A", "default", 1e-2, 1), ("A", "default", 3e-1, 1)]


LADDER = (64, 128, 256)  # the size ladder's widths: the third predicted from the two smallest


QUICK = {"arms": ["A"], "lever_sets": ["default"], "lrs": [1e-2, 3e-1], "seeds": [1]}  # the pilot


# -----------------------------------------------------------------------------
# The study's runs: where each lives, what it trains with


def same_as(arm, lever_set):
    """The (arm, lever set) whose runs these are (ARMS' "same_as"), or None."""
    return ARMS[arm].get("same_as", {}).get(lever_set)


def seeds_at(spec, lr):
    return [*spec["seeds"], *spec.get("more_seeds", {}).get(lr, [])]


def run_dir(out, arm, lever_set, lr, seed, width=WIDTH):
    """Where the run lives: a lever set that is another arm's runs (ARMS' "same_as") lives in that arm's place."""
    arm, lever_set = same_as(arm, lever_set) or (arm, lever_set)
    # the study's own width keeps the paths it ran under
    ladder = [] if width == WIDTH else [f"w{width}"]
    return os.path.join(out, "runs", *ladder, arm, lever_set, f"lr{lr:.0e}-seed{seed}")


def width_args(width):
    """The size ladder's model at `width`: depth fixed, heads of HEAD_DIM (qk-layernorm normalizes over a head, so
    a head keeps its size as the width grows, as in Wortsman et al.'s ladder)."""
    if width == WIDTH:
        return []
    if width % HEAD_DIM:
        raise SystemExit(
            f"lr_sweep: --width {width} is not a multiple of the head size {HEAD_DIM}; use 64, 256, ..."
        )
    return [f"--hidden_size={width}", f"--num_attention_heads={width // HEAD_DIM}"]


def train_args(arm, lever_set, lr, seed, directory, extra=(), width=WIDTH):
    spec = ARMS[arm]
    # its init levers are c / sqrt(WIDTH), written for the study's width
    if width != WIDTH and arm == "C":
        raise SystemExit(
            f"lr_sweep: arm C's init levers are defined at width {WIDTH}; the ladder is arm A's"
        )
    return [
        *BASE,
        *width_args(width),
        *spec["args"],
        *spec["levers"][lever_set],
        f"--lr={lr}",
        f"--seed={seed}",
        f"--save={directory}",
        *extra,
    ]


def width_of(args):
    """The hidden size a run's arguments give (the last --hidden_size wins, as in train.py)."""
    sizes = [int(a.split("=", 1)[1]) for a in args if a.startswith("--hidden_size=")]
    return sizes[-1] if sizes else WIDTH


def config_of(args):
    """The run's validated train.py config (config/tiny.py under the arguments, as train.py builds it)."""
    import arguments

    return arguments.prepare(arguments.load_config(list(args)))


def preflight(arms, extra=(), base=BASE):
    """What keeps a study from showing anything, as a list of sentences (empty: nothing). arms: {name: spec} as
    ARMS; extra: arguments added to every run; base: the arguments every run starts from. Checked: parameters
    mostly in the embedding (the model learns the unigram statistics, and attention has nothing to lose), a
    warm-up under 100 iterations (the runs blow up in the warm-up, not by the slow growths under study), weight
    decay coupled to the LR across an LR grid (the decay per step would vary as much as the LR), a lever
    without its partner (Wortsman et al. test qk-layernorm with z-loss on, z-loss with qk-layernorm on: alone,
    either can fail for the other's reason), and z-loss tested on an output layer that is tied or decayed (what
    holds the logits then need not be the z-loss)."""
    problems = []
    for name, spec in arms.items():
        configs = {
            lever: config_of([*base, *spec["args"], *args, "--lr=0.01", *extra])
            for lever, args in spec["levers"].items()
        }
        found = {}  # sentence -> the lever sets it applies to

        def check(lever, ok, sentence):
            if not ok:
                found.setdefault(sentence, []).append(lever)

        for lever, cfg in configs.items():
            share = cfg.vocab_size * cfg.hidden_size / cfg.num_parameters()
            check(
                lever,
                share <= 0.5,
                f"{share:.0%} of the parameters are the embedding ({cfg.vocab_size} x "
                f"{cfg.hidden_size}): a model that learns the unigram statistics; use a small vocabulary "
                "(lab/bpe_corpus.py) or a wider, deeper model",
            )
            tokens = cfg.global_batch_size * cfg.seq_length
            warmup = (
                cfg.lr_warmup_tokens / tokens
                if cfg.lr_warmup_tokens
                else cfg.lr_warmup_samples / cfg.global_batch_size
            )
            check(
                lever,
                warmup >= 100 or spec.get("short_warmup"),
                f"a warm-up of {warmup:g} iterations: "
                "runs at high LR blow up in the "
                "warm-up, not by the slow growths under study; warm up over 100 iterations or more",
            )
            check(
                lever,
                cfg.weight_decay == 0 or cfg.weight_decay_independent or len(spec["lrs"]) < 2,
                f"weight decay {cfg.weight_decay} coupled to the LR across LRs {min(spec['lrs']):g}.."
                f"{max(spec['lrs']):g}: the decay per step varies {max(spec['lrs']) / min(spec['lrs']):.3g}x; "
                "set weight_decay_independent",
            )
        problems += [
            f"arm {name} ({', '.join(levers)}): {sentence}" for sentence, levers in found.items()
        ]
        qk = {cfg.qk_layernorm for cfg in configs.values()}
        z = {cfg.z_loss > 0 for cfg in configs.values()}
        if len(qk) > 1 and z != {True}:
            problems.append(
                f"arm {name}: qk-layernorm compared without z-loss on every lever set; Wortsman et al. "
                "keep z-loss on (1e-4), so that the output logits cannot be what breaks"
            )
        if len(z) > 1 and qk != {True}:
            problems.append(
                f"arm {name}: z-loss compared without qk-layernorm on every lever set; Wortsman et al. "
                "keep qk-layernorm on, so that the attention logits cannot be what breaks"
            )
        if len(z) > 1 and not all(
            cfg.untie_embeddings_and_output_weights and cfg.weight_decay == 0
            for cfg in configs.values()
        ):
            problems.append(
                f"arm {name}: z-loss compared on a tied output layer or one with weight decay; Wortsman "
                "et al.'s output-logit drift is of an untied output layer without weight decay "
                "(--untie_embeddings_and_output_weights --weight_decay=0)"
            )
    return problems


def with_same_runs(results):
    """results, and each run that is also another arm's lever set (ARMS' "same_as") once more under that label."""
    return results + [
        {**r, "arm": arm, "lever_set": lever}
        for arm, spec in ARMS.items()
        for lever, (other, other_lever) in spec.get("same_as", {}).items()
        for r in results
        if r["arm"] == other and r["lever_set"] == other_lever
    ]


def counted_elsewhere(arm, lever_set, arms):
    """Whether this lever set's runs are another arm's that `arms` holds too (so counted once, there)."""
    target = same_as(arm, lever_set)
    return target is not None and target[0] in arms


def in_selection(r, arms, width=None):
    spec = arms.get(r["arm"])
    return (
        spec is not None
        and r["lever_set"] in spec["levers"]
        and r["lr"] in spec["lrs"]
        and r["seed"] in seeds_at(spec, r["lr"])
        and (width is None or r.get("width", WIDTH) == width)
    )
