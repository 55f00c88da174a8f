"""Faults that stay where they live (stability/faults.py, the seventh campaign's): samples bad in
the corpus, met by whichever pass reads them (a rollback's replay too) and by nothing else, and a
device that stays bad from its onset, a rollback to before it included. Against references built
here: the loader's sample order (loader.sample_indices), the clean batch, and a dataset whose every
token is its sample's index."""

import re

import numpy as np
import pytest
import torch

import arguments
import parallel
import training
from builders import build_model
from stability.faults import Faults

TINY = [
    "--num_layers=1",
    "--hidden_size=32",
    "--num_attention_heads=2",
    "--seq_length=16",
    "--vocab_size=512",
    "--micro_batch_size=2",
    "--global_batch_size=4",
]


class Indexed:
    """A dataset whose sample i is the tokens i + 37 t (mod 512), t = 0, 1, ...: a batch names its
    samples."""

    def gather(self, index, out):
        out[:] = (np.asarray(index)[:, None] + 37 * np.arange(out.shape[1])) % 512


def faults(*flags, world_size=1):
    cfg = arguments.prepare(arguments.load_config([*TINY, *flags]), world_size)
    f = Faults(cfg, None, cfg.seed, cfg.vocab_size)
    f.train_data, f.model = Indexed(), build_model(cfg, torch.device("cpu"))
    return f


def batches(first_sample, micro=2, rows=2, seqlen=16):
    """Clean micro-batches of Indexed from first_sample, in the loader's order (one process: DP rank
    0 of 1)."""
    tokens = (
        torch.arange(first_sample, first_sample + micro * rows)[:, None]
        + 37 * torch.arange(seqlen + 1)
    ) % 512
    tokens = tokens.reshape(micro, rows, seqlen + 1)
    return [(t[:, :-1].clone(), t[:, 1:].clone()) for t in tokens]


def read(f, number, first_sample):
    """What iteration `number` trains on when it reads the samples from first_sample (the loop's
    before_step)."""
    it = training.Iteration(number, first_sample, 4, 16, batches(first_sample), lr=1e-3)
    f.before_step(it)
    return it.batches


def bad_rows(got, clean):
    return [
        (k, j)
        for k, ((x, _), (cx, _)) in enumerate(zip(got, clean))
        for j in range(x.shape[0])
        if not torch.equal(x[j], cx[j])
    ]


@pytest.mark.parametrize("kind", ["random", "repeat", "ngram", "duplicate"])
def test_a_corpus_fault_is_met_again_by_a_rollback_and_removed_by_a_skip_of_its_samples(kind):
    # samples 9-10 are bad: iteration 3 (4 samples a step: 8-11) holds them in micro-batch 0 row 1,
    # micro-batch 1 row 0 (the loader's order), and nothing else
    f = faults(
        "--inject_bad_samples=9-10",
        f"--inject_bad_samples_kind={kind}",
        "--inject_duplicate_period=1",
    )
    first = read(f, 3, 8)
    # a duplicate block's first sample is itself: of 9-10, only 10 (a copy of 9) differs from the
    # clean data
    assert bad_rows(first, batches(8)) == ([(1, 0)] if kind == "duplicate" else [(0, 1), (1, 0)])
    assert [read(f, n, s) for n, s in ((2, 4), (4, 12))] and not bad_rows(read(f, 2, 4), batches(4))
    replay = read(f, 3, 8)  # a rollback past it: iteration 3 read again from sample 8
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(first, replay))
    # a skip of iteration 3 draws samples 8-11 and throws them away: the run goes on from sample 12,
    # clean; and iteration 3's number reading other samples (a skip list that moved the data) is
    # clean too: the fault is in the samples, not in the iteration
    assert not bad_rows(read(f, 4, 12), batches(12)) and not bad_rows(read(f, 3, 12), batches(12))
    if kind == "duplicate":  # sample 10 is a copy of sample 9, read from the data
        assert torch.equal(first[1][0][0], batches(8)[0][0][1])


def test_a_corpus_fault_is_one_sample_wherever_a_batch_meets_it():
    f = faults("--inject_bad_samples=13-13")
    assert bad_rows(read(f, 3, 12), batches(12)) == [(0, 1)]
    assert bad_rows(read(f, 7, 10), batches(10)) == [
        (1, 1)
    ]  # another iteration, another row: the same tokens
    assert torch.equal(read(f, 3, 12)[0][0][1], read(f, 7, 10)[1][0][1])


def test_a_bad_device_corrupts_every_step_from_its_onset_a_rollbacks_replays_included():
    f = faults(
        "--inject_bad_device_iter=5", "--inject_bitflip_bit=30", "--inject_bitflip_element=3"
    )
    matrix = next(p for p in f.model.parameters() if p.dim() == 2)

    def step(number):
        """One step's gradient as the loop leaves it for the update: 0.5 everywhere, then the
        faults' flip."""
        parallel.main_grad(matrix).fill_(0.5)
        read(f, number, 4 * (number - 1))
        f.on_grads(f.model, None)
        f.after_step(None, training.Step(1.0, 1.0, 0, "ok"))
        return parallel.main_grad(matrix).view(-1)[3].item()

    if parallel.main_grad(matrix) is None:  # no gradient buffer: the gradient is .grad
        matrix.grad = torch.zeros_like(matrix)
    assert [step(n) for n in (1, 2, 3, 4)] == [0.5] * 4  # before the onset: healthy
    assert step(5) == 2.0**127 and step(6) == 2.0**127  # bit 30 of 0.5: x 2^128
    assert (
        step(3) == 2.0**127
    )  # a rollback to before the onset: its replays run on the same bad device
    assert (parallel.main_grad(matrix).view(-1)[:3] == 0.5).all()  # one element, as a flipped bit
    # rank 1's device of two; this is rank 0
    healthy = faults("--inject_bad_device_iter=5", "--inject_bitflip_rank=1", world_size=2)
    healthy.before_step(training.Iteration(6, 20, 4, 16, batches(20), lr=1e-3))
    assert healthy.flip_grad is None


@pytest.mark.parametrize(
    "flags, named",
    [
        # it struck no rank: the run went on without a fault, in silence
        (
            ["--inject_bitflip_iters=3-3", "--inject_bitflip_rank=3"],
            "1 process(es): give a rank below 1",
        ),
        (["--inject_bad_device_iter=3", "--inject_bitflip_rank=1"], "give a rank below 1"),
        # DeepSpeed's step: no injection line and no fault (a flip), or an AttributeError mid-run (the state)
        (
            ["--deepspeed", "--bf16", "--zero_stage=1", "--inject_bitflip_iters=3-3"],
            "inject_bitflip_iters act on the gradients, the weights or the optimizer's state, which DeepSpeed",
        ),
        (
            ["--deepspeed", "--bf16", "--zero_stage=1", "--inject_lost_optimizer_state_iter=3"],
            "DeepSpeed keeps",
        ),
        # bitsandbytes' state has other names: "0 moment elements zeroed", a run without the fault
        (
            ["--optimizer=adamw8bit", "--inject_lost_optimizer_state_iter=3"],
            "inject_lost_optimizer_state_iter act on AdamW's exp_avg and exp_avg_sq, which optimizer=adamw8bit",
        ),
        (
            [
                "--optimizer=adamw8bit",
                "--inject_bitflip_iters=3-3",
                "--inject_bitflip_target=exp_avg_sq",
            ],
            "inject_bitflip_target=exp_avg_sq act on AdamW's",
        ),
    ],
)
def test_a_fault_that_would_not_happen_is_refused_before_the_run(flags, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        arguments.validate(arguments.load_config([*TINY, *flags]))


@pytest.mark.parametrize(
    "flag, named",
    [
        ("--inject_bad_samples=9", "inject_bad_samples entry '9'"),
        ("--inject_bad_samples=5-2", "0 <= START <= END"),
        ("--inject_bad_samples_kind=zeros", "inject_bad_samples_kind='zeros'"),
        ("--inject_duplicate_period=0", "inject_duplicate_period must be"),
        ("--inject_bad_device_iter=0", "inject_bad_device_iter must be"),
    ],
)
def test_a_wrong_corpus_or_device_fault_is_refused_naming_its_key(flag, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        arguments.prepare(arguments.load_config([*TINY, "--inject_bad_samples=0-3", flag]))
