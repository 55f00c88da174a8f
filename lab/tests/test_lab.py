"""The stability lab's instruments against references: independent weight decay against torch.optim.AdamW with the
decay applied by hand, the precursors the study reads from the telemetry (lowest attention entropy of a head, grad
RMS, mean output logit, RMS entering the final LayerNorm) against direct computation, the lab's corpus (its
512-token BPE and the entropies under it), and the report's statistics against each seed's own runs (no run
stands in for another, no interval or band over fewer than 3 seeds). The telemetry's TP/PP/DP layouts are compared
key by key, these keys included, in tests/test_spike_guard.py.
"""

import math
import os

import numpy as np
import pytest
import torch

import arguments
import bpe_corpus
import optim
import sweep_arms
import sweep_report
from builders import build_model, build_optimizer, step_rules
from stability import telemetry
from training import whole_step

# -----------------------------------------------------------------------------
# independent weight decay


def _params(seed):
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _linear(weight, bias=True):
    layer = torch.nn.Linear(4, 8, bias=bias).double()
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias:
            layer.bias.copy_(torch.linspace(-1, 1, 8))
    return layer


def _run(optimizer, params, lrs, grads=None):
    """Step optimizer through the LRs with the given gradients (a list per step), zero gradients by default."""
    for i, lr in enumerate(lrs):
        for j, p in enumerate(params):
            p.grad = grads[i][j].clone() if grads else torch.zeros_like(p)
        optim.set_lr(optimizer, lr)
        optimizer.step()
    return [p.detach().clone() for p in params]


def test_independent_weight_decay_matches_torch_adamw_with_the_decay_applied_by_hand():
    peak, wd = 0.3, 0.05  # large, so that a wrong decay shows
    # warm-up, constant, decay, lr 0
    schedule = [peak * s for s in (0.25, 0.5, 1.0, 1.0, 0.6, 0.1, 0.0)]
    gen = torch.Generator().manual_seed(1)
    grads = [
        [
            torch.randn(8, 4, generator=gen, dtype=torch.float64),
            torch.randn(8, generator=gen, dtype=torch.float64),
        ]
        for _ in schedule
    ]
    ours = _linear(_params(0))
    opt = optim.build_optimizer(ours, peak, wd, 0.9, 0.95, 1e-8, independent_decay=True)
    # the bias is not decayed
    assert [g["weight_decay"] for g in opt.param_groups] == [wd / peak, 0.0]
    got = _run(opt, [ours.weight, ours.bias], schedule, grads)
    # the reference: torch's AdamW without decay, each step preceded by weight *= 1 - wd * lr_t / peak
    ref = _linear(_params(0))
    torch_adam = torch.optim.AdamW(
        ref.parameters(), lr=peak, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0
    )
    for lr, (g_weight, g_bias) in zip(schedule, grads):
        ref.weight.grad, ref.bias.grad = g_weight.clone(), g_bias.clone()
        with torch.no_grad():
            ref.weight.mul_(1 - wd * lr / peak)
        torch_adam.param_groups[0]["lr"] = lr
        torch_adam.step()
    torch.testing.assert_close(got[0], ref.weight.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got[1], ref.bias.detach(), rtol=1e-12, atol=1e-14)
    without = _linear(_params(0))
    plain = _run(
        optim.build_optimizer(without, peak, 0.0, 0.9, 0.95, 1e-8),
        [without.weight, without.bias],
        schedule,
        grads,
    )
    assert (plain[0] - got[0]).abs().max() > 1e-3  # the decay is really there


def test_independent_weight_decay_per_step_does_not_depend_on_the_lr():
    # zero gradients: Adam's update is 0, so each step only decays, by exactly 1 - wd * s_t
    shape = [0.25, 0.5, 1.0, 1.0, 0.6, 0.1]
    wd = 1e-2
    finals = {}
    for peak in (1e-3, 1.0):
        model = _linear(_params(0), bias=False)
        opt = optim.build_optimizer(model, peak, wd, 0.9, 0.95, 1e-8, independent_decay=True)
        finals[peak] = _run(opt, [model.weight], [peak * s for s in shape])[0]
    expected = _params(0) * math.prod(1 - wd * s for s in shape)
    for peak, final in finals.items():
        torch.testing.assert_close(final, expected, rtol=1e-14, atol=0, msg=f"peak lr {peak}")
    # coupled (the default): the decay per step is wd * lr_t, 1000x weaker at the small LR
    model = _linear(_params(0), bias=False)
    opt = optim.build_optimizer(model, 1e-3, wd, 0.9, 0.95, 1e-8)
    coupled = _run(opt, [model.weight], [1e-3 * s for s in shape])[0]
    torch.testing.assert_close(
        coupled, _params(0) * math.prod(1 - wd * 1e-3 * s for s in shape), rtol=1e-14, atol=0
    )
    # lr 0: no division by zero, no decay
    assert optim.decay_coefficient(1e-4, 0.0, independent=True) == 0.0


def test_weight_decay_independent_reaches_the_optimizer_from_the_config():
    cfg = arguments.prepare(
        arguments.load_config(
            [
                "--num_layers=1",
                "--hidden_size=16",
                "--num_attention_heads=2",
                "--seq_length=8",
                "--vocab_size=512",
                "--lr=0.02",
                "--weight_decay=1e-4",
                "--weight_decay_independent",
            ]
        )
    )
    model = build_model(cfg, torch.device("cpu"))
    groups = build_optimizer(cfg, model).param_groups
    assert {g["name"]: g["weight_decay"] for g in groups} == {
        "decay": pytest.approx(1e-4 / 0.02),
        "no_decay": 0.0,
    }


# -----------------------------------------------------------------------------
# the precursors of the telemetry


def test_telemetry_precursors_match_direct_computation():
    H, T, D = 2, 16, 16
    cfg = arguments.prepare(
        arguments.load_config(
            [
                "--num_layers=2",
                "--hidden_size=32",
                "--num_attention_heads=2",
                "--seq_length=16",
                "--micro_batch_size=2",
                "--global_batch_size=4",
                "--hidden_dropout=0",
                "--attention_dropout=0",
                "--lr=1e-3",
                "--init_method_std=0.1",
                "--clip_grad=1e9",
            ]
        )
    )  # p.grad unclipped
    cpu = torch.device("cpu")
    model = build_model(cfg, cpu)
    with torch.no_grad():  # head 0's queries 4x larger: its attention is sharper than head 1's
        for block in model.blocks.values():
            block.attn.qkv.weight[:D] *= 4  # rows laid out [heads, (q, k, v), head_dim]
    optimizer, scaler = build_optimizer(cfg, model), optim.scaler_for(cfg)
    gen = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, 50257, (2, T), generator=gen),
            torch.randint(0, 50257, (2, T), generator=gen),
        )
        for _ in range(2)
    ]
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    recorder = telemetry.Telemetry(model, cfg)
    recorder.begin()
    outcome = whole_step(
        model,
        optimizer,
        scaler,
        batches,
        1e-3,
        step_rules(cfg),
        cpu,
        callbacks=telemetry.Probe(recorder),
    ).outcome
    stats = recorder.finish()
    assert outcome == "ok"
    params = dict(model.named_parameters())

    # the gradient RMS of a layer's parameters (the tied embedding counted once, in the embedding)
    def rms(
        prefix,
    ):
        grads = [params[n].grad.double().flatten() for n in params if n.startswith(prefix)]
        return torch.cat(grads).square().mean().sqrt().item()

    for slot, prefix in enumerate(("embed.", "blocks.0.", "blocks.1.", "ln_f.")):
        assert math.isclose(stats["grad rms"][slot], rms(prefix), rel_tol=1e-4), prefix
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(before[name])
        entropy = {0: [], 1: []}  # per layer: (tokens of the batch, heads, queries) entropies
        final_in, logits = [], []
        for x, _ in batches:
            h = model.embed(x)
            for i, block in model.blocks.items():
                q, k, _v = (
                    block.attn.qkv(block.ln_1(h)).view(2, T, H, 3, D).transpose(1, 2).unbind(dim=3)
                )
                s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)
                p = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf).softmax(-1)
                entropy[int(i)].append(-(p * p.clamp_min(1e-300).log()).sum(-1))  # (2, H, T)
                h = block(h)
            final_in.append(h.double().square().mean().item())
            logits.append((model.ln_f(h) @ model.embed.word.weight.T)[..., :50257].double())
    for layer in (0, 1):
        per_head = torch.cat(entropy[layer]).mean(dim=(0, 2))  # mean over the batch and the queries
        assert math.isclose(
            stats["attention entropy min"][layer], per_head.min().item(), rel_tol=1e-4
        )
        assert per_head.max() > 1.05 * per_head.min()  # two different heads: min picks one
    assert math.isclose(
        stats["final layernorm input rms"], math.sqrt(sum(final_in) / 2), rel_tol=1e-4
    )
    assert math.isclose(
        stats["final layernorm input rms"], stats["block output rms"][-1], rel_tol=1e-6
    )
    assert math.isclose(
        stats["output logit mean"], torch.cat(logits).mean().item(), rel_tol=1e-4, abs_tol=1e-7
    )
    assert model.ln_f._forward_pre_hooks == {}  # the probes are gone
    names = telemetry.scalars(stats)
    assert (
        "telemetry/attention-entropy-min/layer-02" in names and "telemetry/grad-rms/final" in names
    )


def test_attention_entropy_of_uniform_and_one_hot_attention():
    """Zero queries and keys attend uniformly: entropy ln(t) at query t (1-based), so the mean over T queries is
    mean(ln 1 .. ln T); a huge logit on the diagonal makes it 0."""
    cfg = arguments.prepare(
        arguments.load_config(
            [
                "--num_layers=1",
                "--hidden_size=32",
                "--num_attention_heads=2",
                "--seq_length=8",
                "--vocab_size=512",
            ]
        )
    )
    model = build_model(cfg, torch.device("cpu"))
    recorder = telemetry.Telemetry(model, cfg)
    recorder.begin()
    zeros = torch.zeros(3, 2, 8, 16)
    recorder._attention(0, zeros, zeros)
    assert math.isclose(
        recorder.entropy[0].item() / recorder.entropy[2].item(),
        sum(math.log(t) for t in range(1, 9)) / 8,
        rel_tol=1e-5,
    )
    recorder.begin()
    eye = torch.eye(8, 16).expand(3, 2, 8, 16) * 100.0  # q.k = 1e4 / 4 on the diagonal, 0 elsewhere
    recorder._attention(0, eye, eye)
    assert recorder.entropy[:2].abs().max().item() < 1e-6
    recorder.finish()


# -----------------------------------------------------------------------------
# the lab's corpus


def test_entropies_on_hand_made_documents():
    # unigram: counts a 4, b 2, c 2 of 8: H1 = -(1/2 ln 1/2 + 2 * 1/4 ln 1/4)
    docs = [[0, 1, 0, 2], [0, 0, 1, 2]]
    h1, h2 = bpe_corpus.entropies(docs, vocab_size=3)
    assert math.isclose(h1, 1.5 * math.log(2), rel_tol=1e-12)
    # pairs within documents: (0,1) (1,0) (0,2) | (0,0) (0,1) (1,2): after 0 -> 1, 2, 0, 1 (H = 1.5 ln 2),
    # after 1 -> 0, 2 (H = ln 2); weighted 4/6 and 2/6
    assert math.isclose(h2, 4 / 6 * 1.5 * math.log(2) + 2 / 6 * math.log(2), rel_tol=1e-12)
    assert bpe_corpus.entropies([[5, 5, 5]], vocab_size=8) == (0.0, 0.0)


def test_bpe_corpus_builds_a_512_token_bpe_once(tmp_path):
    import data

    summary = bpe_corpus.build(str(tmp_path))
    tok = data.get_tokenizer(summary["tokenizer_file"])
    assert (
        tok.n_vocab == 512
        and tok.decode(tok.encode_ordinary("ROMEO: But soft!")) == "ROMEO: But soft!"
    )
    indexed = data.IndexedDataset(summary["prefix"])
    assert len(indexed) == 38 and summary["tokens"] == sum(len(indexed.get(i)) for i in range(38))
    assert all(indexed.get(i)[-1] == tok.eot_token for i in range(38))
    first = indexed.get(0)
    text = data.bundled_plays(bpe_corpus.CORPUS_VERSION)[0]
    assert (first < 512).all() and len(tok.encode_ordinary(text)) + 1 == len(first)
    # the corpus the study's finished runs were trained on (lab/stability.md): another would need a new study
    assert summary["tokens"] == 2_666_329 and round(summary["bigram_entropy"], 3) == 3.509
    # the entropies are those of the tokens written; unigram < uniform, and the previous token tells a lot
    docs = [np.asarray(indexed.get(i)) for i in range(38)]
    assert (summary["unigram_entropy"], summary["bigram_entropy"]) == bpe_corpus.entropies(
        docs, 512
    )
    assert summary["bigram_entropy"] < summary["unigram_entropy"] - 1 < math.log(512) - 1
    stamp = os.path.getmtime(summary["tokenizer_file"])
    assert (
        bpe_corpus.build(str(tmp_path)) == summary
        and os.path.getmtime(summary["tokenizer_file"]) == stamp
    )


def test_bpe_corpus_is_rebuilt_for_another_corpus_version(tmp_path, monkeypatch):
    """A data/lab/ of another version (or of none: built before versions) is not reused."""
    import data

    rng = np.random.default_rng(0)  # text enough for 255 merges
    words = ["".join(rng.choice(list("abcdefghij"), size=rng.integers(2, 7))) for _ in range(20000)]
    plays = [[" ".join(words)], [" ".join(words[:10000])]]
    monkeypatch.setattr(data, "bundled_plays", lambda version: plays[version - 1])
    monkeypatch.setattr(bpe_corpus, "CORPUS_VERSION", 1)
    first = bpe_corpus.build(str(tmp_path))
    assert first["corpus_version"] == 1 and bpe_corpus.build(str(tmp_path)) == first
    monkeypatch.setattr(bpe_corpus, "CORPUS_VERSION", 2)
    second = bpe_corpus.build(str(tmp_path))
    assert second["corpus_version"] == 2 and second["tokens"] != first["tokens"]


def test_bundled_plays_as_markdown_and_as_plain_text():
    import data

    markdown, plain = data.bundled_plays(1), data.bundled_plays(2)
    assert len(markdown) == len(plain) == 38 and plain == [data.play_text(m) for m in markdown]
    assert "**" in markdown[0] and "**" not in plain[0] and not any(" \n" in m for m in markdown)
    with pytest.raises(ValueError, match="no bundled corpus version 3"):
        data.bundled_plays(3)


# -----------------------------------------------------------------------------
# the report's statistics: what was run, and nothing else

H2 = 3.509
CORPUS = {"tokens": 2_666_329, "unigram_entropy": 5.219, "bigram_entropy": H2}
LEARNED = [6.0, 4.0] + [3.2] * 98  # 10-iteration loss means: clearly below H2 from iteration 20 on
FLAT = [6.0] + [4.2] * 99  # never below H2


def _record(lever_set, lr, seed, loss, loss10=LEARNED, logit=50.0, arm="A"):
    return {
        "arm": arm,
        "lever_set": lever_set,
        "lr": lr,
        "seed": seed,
        "val_loss": loss,
        "loss10": loss10,
        "attention_logit_max": logit,
        "spike_score": 0.001 * seed,
    }


def _partial_study():
    """Arm A as the old study ran it: seed 1 at every LR of the grid, seed 2 at 3e-2 only, seeds 2 and 3 of the
    default at 1e-2; every loss distinct, so that a substituted one would show."""
    records = []
    for i, lr in enumerate(sweep_arms.HALF_DECADES):
        records.append(_record("default", lr, 1, 3.2 + 0.4 * i + 0.001))
        records.append(_record("qk_layernorm", lr, 1, 3.3 + 0.1 * i + 0.002))
    records += [
        _record("default", 3e-2, 2, 3.9),
        _record("qk_layernorm", 3e-2, 2, 3.1),
        _record("default", 1e-2, 2, 3.5),
        _record("default", 1e-2, 3, 3.45),
    ]
    return records


def _own_sensitivity(records, lever_set, seed, lrs):
    return sweep_report.sensitivity(
        {
            r["lr"]: r["val_loss"]
            for r in records
            if r["lever_set"] == lever_set and r["seed"] == seed and r["lr"] in lrs
        }
    )


def test_the_report_never_substitutes_a_run_and_shows_n_per_cell():
    records = _partial_study()
    grid = sweep_arms.HALF_DECADES
    rows = sweep_report.summarize(records, "A", ["default", "qk_layernorm"], grid, H2)
    table = sweep_report.markdown({"A": rows}, {"A": grid}, CORPUS, [])
    wortsman = [lr for lr in grid if lr <= 0.3]
    for lever_set in ("default", "qk_layernorm"):
        own = _own_sensitivity(records, lever_set, 1, grid)
        # what the old report printed as seeds 2 and 3's curves: their runs, seed 1's standing in elsewhere
        for seed in {r["seed"] for r in records if r["lever_set"] == lever_set} - {1}:
            stand_in = {
                r["lr"]: r["val_loss"]
                for r in records
                if r["lever_set"] == lever_set and r["seed"] == 1
            }
            stand_in.update(
                {
                    r["lr"]: r["val_loss"]
                    for r in records
                    if r["lever_set"] == lever_set and r["seed"] == seed
                }
            )
            substituted = sweep_report.sensitivity(stand_in)
            assert f"{substituted:.3f}" not in table, (
                f"{lever_set}: seed 1's runs standing in for seed {seed}'s"
            )
        assert f"{own:.3f} (seed 1)" in table
        assert f"{_own_sensitivity(records, lever_set, 1, wortsman):.3f} (seed 1)" in table
    for row in rows:  # every sensitivity is a seed's own curve's, over a range the seed ran whole
        for label, entry in row["ranges"].items():
            for seed, value in entry["seeds"].items():
                assert value == _own_sensitivity(records, row["lever_set"], seed, entry["lrs"]), (
                    label,
                    seed,
                )
            assert set(entry["seeds"]) == {1}
    # each cell its n; the seeds' values for n < 3, an interval only at n = 3
    default = next(
        line for line in table.splitlines() if line.startswith("| default | 3.201 (n=1) |")
    )
    assert "| 3.650 [3.450-4.001] (n=3) |" in default and "| 4.401, 3.900 (n=2) |" in default
    assert "Wortsman et al.'s range" in table and "1e-03..3e-01" in table


def test_the_figure_draws_each_run_and_no_band_over_fewer_than_three_seeds(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure

    records = _partial_study()
    grid = sweep_arms.HALF_DECADES
    rows = sweep_report.summarize(records, "A", ["default", "qk_layernorm"], grid, H2)
    figures = []
    save = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k))
    )
    sweep_report.plot({"A": rows}, records, CORPUS, str(tmp_path / "lab.png"))
    (fig,) = figures
    loss_axes = fig.axes[0]
    n = {
        (r["lever_set"], r["lr"]): sum(
            q["lever_set"] == r["lever_set"] and q["lr"] == r["lr"] for q in records
        )
        for r in records
    }
    for (
        band
    ) in loss_axes.collections:  # fill_between's polygons: none over an LR with fewer than 2 seeds
        if isinstance(band, PolyCollection):
            for path in band.get_paths():
                xs = set(path.vertices[:, 0].round(12))
                assert all(
                    min(k for (_, lr), k in n.items() if round(lr, 12) == x) >= 2 for x in xs
                ), xs
    bars = [c for c in loss_axes.containers]
    assert len(bars) == 1  # the default's 3 seeds at 1e-2: the only cell with an interval
    (segments,) = bars[0].lines[2]
    assert [tuple(s[:, 0]) for s in segments.get_segments()] == [(1e-2, 1e-2)]
    assert [tuple(s[:, 1]) for s in segments.get_segments()] == [pytest.approx((3.45, 4.001))]
    # the dots are the runs, each once, at its own loss
    dots = sorted(
        (round(x, 12), round(y, 12))
        for line in loss_axes.lines
        if line.get_marker() == "o"
        for x, y in zip(line.get_xdata(), line.get_ydata())
    )
    assert dots == sorted((round(r["lr"], 12), round(r["val_loss"], 12)) for r in records)
    logits = [line for line in fig.axes[1].lines if line.get_marker() == "o"]
    assert sum(len(line.get_xdata()) for line in logits) == len(records)


def test_blow_up_of_the_arm_that_tests_the_attention_logits_does_not_use_them():
    """Arm A tests the attention logits: a run that stalls with a logit past 1e4 is `flat` and `logit`, not `up`;
    arm B, which tests log Z, still counts such a logit as a blow-up."""
    stalled = _record("default", 3e-2, 1, 4.2, loss10=FLAT, logit=2e4)
    # up after iteration 600
    lost = _record("default", 3e-2, 2, 4.3, loss10=LEARNED[:60] + [4.0] * 40, logit=20.0)
    (row,) = sweep_report.summarize([stalled, lost], "A", ["default"], [3e-2], H2)
    p = row["points"][3e-2]
    assert (p["n"], p["blew_up"], p["never_below"]) == (2, 1, 1)  # `lost` alone
    assert p["logit_past_1e4"] == 1
    b = [{**r, "arm": "B", "lever_set": "z_loss"} for r in (stalled, lost)]
    (row,) = sweep_report.summarize(b, "B", ["z_loss"], [3e-2], H2)
    assert (row["points"][3e-2]["blew_up"], row["points"][3e-2]["logit_past_1e4"]) == (2, 1)
    assert not sweep_arms.ARMS["A"]["logit_blows_up"] and sweep_arms.ARMS["B"].get(
        "logit_blows_up", True
    )
