"""Survivors of issue #51's mutation audit outside the stability layer, each held by what it would
change:

- Megatron-DeepSpeed import: a ZeRO group padded at its end for alignment is read (the import's own
  fixture's sizes never pad); the LR schedule continues from Megatron's num_steps (applied
  iterations), not from consumed samples;
- lm-eval: a continuation is greedy when its own tokens are the argmax, whatever the context's are;
- export: an imported model's pad_token_id is kept; the remote code's ALiBi slopes for a head count
  that is not a power of two are BLOOM's (the ALiBi paper's reference code);
- data: a named validation set leaves out the skip list's documents;
- launch.start hands each of the two collective timeouts to its own place.
"""

import argparse
import importlib
import json
import math
import types
from collections import OrderedDict

import numpy as np
import pytest
import torch

import arguments
import parallel
from helpers import corpus, corpus512, write_checkpoint  # noqa: F401 (fixtures)

# -----------------------------------------------------------------------------
# Megatron-DeepSpeed import


class ZeroCheckpoint:
    """What megatron_ds.adam_states reads of a checkpoint, held in memory: one stage, one TP rank,
    DP=2, one param group of 7 values padded to 8 at its end (DeepSpeed aligns each group to a
    multiple of 2 x DP) and cut in two, the BF16 optimizer's layout (the step in the param
    group)."""

    universal, dir = False, "(in memory)"

    def __init__(self):
        self.flat = {
            k: torch.arange(8, dtype=torch.float32) + 10 * i
            for i, k in enumerate(("fp32", "exp_avg", "exp_avg_sq"))
        }
        for t in self.flat.values():
            t[7] = 0.0  # the alignment padding

    def param_shapes(self, pp, tp):
        return [OrderedDict([("a", torch.Size([3])), ("b", torch.Size([2, 2]))])]

    def zero_shards(self, pp, tp, ranks=None):
        return [
            {
                "single_partition_of_fp32_groups": [self.flat["fp32"].chunk(2)[dp].clone()],
                "base_optimizer_state": {
                    "state": {
                        0: {k: self.flat[k].chunk(2)[dp].clone() for k in ("exp_avg", "exp_avg_sq")}
                    },
                    "param_groups": [{"step": 5}],
                },
            }
            for dp in range(2)
        ]


def test_a_zero_group_padded_for_alignment_is_read():
    megatron_ds = pytest.importorskip("megatron_ds")
    ckpt = ZeroCheckpoint()
    states = megatron_ds.adam_states(ckpt, 0, 0)
    for k, flat in ckpt.flat.items():
        assert torch.equal(states["a"][k], flat[:3]) and torch.equal(
            states["b"][k], flat[3:7].view(2, 2)
        ), k
    assert states["a"]["step"] == states["b"]["step"] == 5


def test_the_lr_schedule_continues_from_megatrons_applied_iterations():
    """Megatron's scheduler counts the samples of applied iterations (num_steps);
    consumed_train_samples counts skipped ones too. 12 iterations of 4 samples, 2 of them skipped:
    the schedule is at 40 samples, the data at 48."""
    megatron_ds = pytest.importorskip("megatron_ds")
    cfg = arguments.prepare(
        arguments.load_config(
            [
                "--global_batch_size=4",
                "--micro_batch_size=4",
                "--lr_warmup_samples=44",
                "--save=none",
                "--save_interval=none",
            ]
        )
    )
    ckpt = types.SimpleNamespace(
        args=argparse.Namespace(consumed_train_samples=48, consumed_train_tokens=48 * 64),
        zero=None,
        state={
            "iteration": 12,
            "tokens": 48 * 64,
            "lr_scheduler": {"num_steps": 40, "num_tokens": 48 * 64},
        },
    )
    run = megatron_ds.run_dict(ckpt, cfg)
    assert run["state"]["scheduler_samples"] == 40 and run["state"]["consumed_samples"] == 48
    assert (
        run["scheduler"].get("warmup_end_tokens") is None
    )  # 40 < 44: still warming up (48 would not be)


# -----------------------------------------------------------------------------
# lm-eval's is_greedy


def test_a_greedy_continuation_after_a_context_that_is_not_greedy_is_greedy():
    """lm-eval's is_greedy: every continuation token is the argmax after what precedes it. The
    context's own tokens are no part of it (a random context is never the model's greedy text); the
    padding of a shorter sequence in the batch neither."""
    pytest.importorskip("lm_eval")
    import eval_harness
    import tokenizer
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(
        GPTConfig(
            num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=32, vocab_size=50257
        )
    )
    lm = eval_harness.StableGPT(gpt, tokenizer.get_tokenizer(), batch_size=2)
    context = [464, 2068, 7586, 21831, 18045, 625, 262, 16931]
    greedy = list(context)
    for _ in range(3):
        greedy.append(int(lm.logits(torch.tensor([greedy]))[0, -1].argmax()))
    argmax = lm.logits(torch.tensor([greedy[:-1]]))[0].argmax(-1).tolist()
    assert (
        argmax[: len(context) - 1] != greedy[1 : len(context)]
    )  # the context is not the model's greedy text
    other = greedy[:-1] + [(greedy[-1] + 1) % 50257]
    (_, yes), (_, no), (_, short) = lm.score([greedy, other, context[:3] + greedy[-1:]], [3, 3, 1])
    assert yes is True and no is False
    assert short == (int(lm.logits(torch.tensor([context[:3]]))[0, -1].argmax()) == greedy[-1])


# -----------------------------------------------------------------------------
# Export


def test_an_export_keeps_the_imported_models_pad_token_id(tmp_path):
    """A run started from a Hugging Face model (init_from_hf) exports with that model's special
    token ids; its pad_token_id among them (generation pads with it)."""
    transformers = pytest.importorskip("transformers")
    import sys

    from helpers import ROOT

    sys.path.insert(0, f"{ROOT}/tools")
    import export_hf

    origin = tmp_path / "origin"
    transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_positions=32,
        vocab_size=50257,
        bos_token_id=50256,
        eos_token_id=50256,
        pad_token_id=7,
    ).save_pretrained(origin)
    write_checkpoint(
        str(tmp_path / "ckpt"), [f"--init_from_hf={origin}", "--seq_length=32"], fill=lambda s: None
    )
    export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (
        7,
        50256,
        50256,
    )


def press_slopes(n):
    """The ALiBi paper's reference (Press et al., get_slopes), as BLOOM computes its 112 heads'
    slopes."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    c = 2 ** math.floor(math.log2(n))
    return power_of_2(c) + press_slopes(2 * c)[0::2][: n - c]


@pytest.mark.parametrize("heads", [3, 6, 12, 112])
def test_the_remote_codes_alibi_slopes_for_any_head_count_are_blooms(heads):
    pytest.importorskip("transformers")
    import model

    remote = importlib.import_module("hf_remote.modeling_stablegpt")
    expected = torch.tensor(press_slopes(heads), dtype=torch.float64)
    assert torch.allclose(remote.alibi_slopes(heads), expected, rtol=1e-12, atol=0)
    assert torch.allclose(model.alibi_slopes(heads), expected, rtol=1e-12, atol=0)


# -----------------------------------------------------------------------------
# Data


def samples(dataset, n, seqlen):
    out = np.empty((n, seqlen + 1), np.int64)
    dataset.gather(list(range(n)), out)
    return out


def test_a_named_validation_set_leaves_out_the_skip_lists_documents(corpus512):
    """Every other document of the corpus on the skip list: the named set built by the source reads
    what data.build_datasets reads with that skip list, which is not what it reads without one."""
    import data
    import loader

    split, seq = "949,50,1", 64
    data_cfg = loader.DataConfig(
        data_path=[corpus512],
        split=split,
        seed=1234,
        valid_weighted_split_names=["it"],
        valid_weighted_split_paths=[corpus512],
    )
    context = loader.DataContext(seq, 512, None, False, 0, 1)
    skip = np.arange(0, len(data.IndexedDataset(corpus512)), 2, dtype=np.int64)
    _, valid = loader.MegatronSource(data_cfg, context, (16, 16)).build([skip])
    by_hand = data.build_datasets([corpus512], split, seq, 1234, (0, 16, 0), None, [skip])[1]
    unskipped = data.build_datasets([corpus512], split, seq, 1234, (0, 16, 0))[1]
    got = samples(valid["it"], 16, seq)
    assert np.array_equal(got, samples(by_hand, 16, seq))
    assert not np.array_equal(got, samples(unskipped, 16, seq))


# -----------------------------------------------------------------------------
# Launch


def test_each_collective_timeout_goes_to_its_own_place(monkeypatch):
    """distributed_timeout_minutes: the training collectives' (what a hung rank costs);
    host_work_timeout_minutes: the host group's waits (a checkpoint's files, an index build)."""
    import launch
    from sections import section

    given = {}

    def init(tp, pp, **kwargs):
        given.update(kwargs)
        return parallel.grid

    monkeypatch.setattr(parallel, "init", init)
    cfg = arguments.load_config(
        ["--distributed_timeout_minutes=7", "--host_work_timeout_minutes=90", "--device=cpu"]
    )
    launch.start(section(parallel.LayoutConfig, cfg), cfg.tensor_model_parallel_size)
    assert (given["timeout_minutes"], given["host_timeout_minutes"]) == (7, 90)
