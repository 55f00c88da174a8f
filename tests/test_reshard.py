"""Checkpoints that change topology (reshard.py).

Unit level, in one process (a Grid "on paper" stands for each rank of the old layout): re-slicing with the
vocabulary padding dropped and re-padded; a TP=2 x PP=2 x DP=2 ZeRO-1 checkpoint written rank by rank through
run_state.save and loaded as one process gives exactly the full weights and Adam state; replicated copies
that differ and 8-bit states across a TP change are refused with the parameter named.
End to end (torchrun): 6 iterations at TP2 x PP2, resumed at TP1 x PP1 and at DP2 with ZeRO-1: the losses
follow a straight 12-iteration run within 1e-5.
"""

import math
import os

import pytest
import torch

import arguments
import checkpoint
import optim
import parallel
import reshard
import run_state
import training
from builders import build_model, build_optimizer
from helpers import launch, plan_of, synthetic_corpus  # noqa: F401 (synthetic_corpus is a fixture)
from model import GPT


def test_slice_drops_and_repads_the_vocabulary():
    full = torch.arange(300 * 3, dtype=torch.float32).view(300, 3)
    old = torch.cat([full, torch.full((212, 3), 7.0)]).chunk(2)  # TP=2 pads 300 rows to 512
    one = reshard.reslice(list(old), 0, 300, 384, 1, 0)  # TP=1 pads to 384
    assert torch.equal(one[:300], full) and not one[300:].any()
    # and back to TP=4: 4 x 128 rows
    four = [reshard.reslice([one], 0, 300, 512, 4, r) for r in range(4)]
    assert torch.equal(torch.cat(four)[:300], full) and not torch.cat(four)[300:].any()
    cols = torch.randn(4, 6)  # a row-parallel weight: split along dim 1
    assert torch.equal(reshard.reslice(list(cols.chunk(3, 1)), 1, 6, 6, 2, 1), cols[:, 3:])


CFG = [
    "--num_layers=4",
    "--hidden_size=32",
    "--num_attention_heads=4",
    "--seq_length=16",
    "--vocab_size=300",
    "--embed_layernorm",
    "--position_embedding_type=alibi",
    "--train_iters=10",
    "--device=cpu",
    "--micro_batch_size=2",
    "--global_batch_size=8",
]


def _save_one_rank(save_dir, iteration, model_state, run_state, rank_state, write_model_state):
    """checkpoint.save without its barriers and renames, which need all ranks at once: each rank's files go
    straight into the final directory."""
    tag_dir = os.path.join(save_dir, f"global_step{iteration}")
    os.makedirs(tag_dir, exist_ok=True)
    if write_model_state:
        blob = {"model": model_state, "run": run_state, "topology": checkpoint.topology()}
        torch.save(blob, checkpoint.model_file(tag_dir))
    torch.save(rank_state, checkpoint.rank_file(tag_dir))
    with open(os.path.join(save_dir, checkpoint.LATEST), "w") as f:
        f.write(f"global_step{iteration}\n")
    return tag_dir


def _save_layout(directory, tp, pp, dp, zero_stage, cfg_args=(), mutate=None, optimizer_reset=None):
    """Write a checkpoint of a TP x PP x DP layout from this one process, rank by rank, through the trainer's
    own run_state.save (collectives are not needed: each rank only writes its files). The model is the
    deterministic init; every Adam state is made up from the weights so that a wrong mapping shows.
    optimizer_reset: the run state's (a reset of lesson 8 done before the save)."""
    cfg = arguments.load_config(
        [
            *CFG,
            f"--tensor_model_parallel_size={tp}",
            f"--pipeline_model_parallel_size={pp}",
            f"--zero_stage={zero_stage}",
            f"--save={directory}",
            *cfg_args,
        ]
    )
    arguments.prepare(cfg, tp * pp * dp)
    saved, save = parallel.grid, checkpoint.save
    checkpoint.save = _save_one_rank
    try:
        for rank in range(tp * pp * dp):
            parallel.grid = parallel.Grid(tp, pp, world_size=tp * pp * dp, rank=rank)
            model = build_model(cfg, "cpu")
            optimizer = build_optimizer(cfg, model)
            inner = getattr(optimizer, "optimizer", optimizer)
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p] = {
                        "step": 7,
                        "exp_avg": p.detach() * 2,
                        "exp_avg_sq": p.detach() ** 2,
                    }
            if mutate:
                mutate(model, inner)
            state = run_state.RunState(
                iteration=10,
                consumed_samples=80,
                consumed_tokens=1280,
                scheduler_samples=80,
                scheduler_tokens=1280,
                optimizer_reset=optimizer_reset,
            )
            plan = plan_of(cfg, parallel.grid.dp_size)
            run_state.save(
                run_state.Parts(
                    cfg,
                    model,
                    optimizer,
                    plan,
                    optim.scaler_for(cfg),
                    training.NO_CALLBACKS,
                    state=state,
                )
            )
    finally:
        parallel.grid, checkpoint.save = saved, save


def _load_one_process(directory, *extra, tp=1, rank=0):
    """Load as one process, or as rank `rank` of a TP=tp layout (on paper: loading needs no collectives)."""
    cfg = arguments.load_config(
        [*CFG, f"--load={directory}", f"--tensor_model_parallel_size={tp}", *extra]
    )
    arguments.prepare(cfg, tp)
    saved = parallel.grid
    parallel.grid = parallel.Grid(tp, 1, world_size=tp, rank=rank)
    try:
        return _load(cfg)
    finally:
        parallel.grid = saved


def _load(cfg):
    model = build_model(cfg, "cpu")
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optimizer = build_optimizer(cfg, model)
    parts = run_state.Parts(
        cfg, model, optimizer, plan_of(cfg), optim.scaler_for(cfg), training.NO_CALLBACKS
    )
    run_state.load(parts)
    return model, optimizer, parts.state, reference


def test_tp2_pp2_dp2_zero1_checkpoint_loads_as_one_process(tmp_path, capsys):
    _save_layout(tmp_path, 2, 2, 2, zero_stage=1)
    model, optimizer, state, reference = _load_one_process(tmp_path)
    out = capsys.readouterr().out
    assert "saved with TP=2 x PP=2 x DP=2, now TP=1 x PP=1 x DP=1" in out
    assert "fresh streams seeded with seed + iteration = 1244" in out
    assert state.iteration == 10 and state.consumed_samples == 80
    padded = model.embed.word.weight.shape[0]
    assert padded == 384  # 300 padded for TP=1 (it was 512 for TP=2)
    for name, p in model.named_parameters():
        rows = slice(0, 300) if name == "embed.word.weight" else slice(None)
        assert torch.equal(p[rows], reference[name][rows]), name
        s = optimizer.state[p]
        assert s["step"] == 7, name
        assert torch.equal(s["exp_avg"][rows], 2 * reference[name][rows]), name
        assert torch.equal(s["exp_avg_sq"][rows], reference[name][rows] ** 2), name
    word = model.embed.word.weight
    assert not word[300:].any() and not optimizer.state[word]["exp_avg"][300:].any()


def test_bf16_fp32_masters_are_resharded_not_rounded(tmp_path):
    """Under bf16 the checkpoint's truth is the fp32 masters (lesson 6): they are re-sliced like the parameter,
    and the model's weights are those masters rounded -- not the template's masters of a fresh optimizer."""
    # smaller than bf16's spacing at the weights' size: the masters hold what the weights cannot
    delta = 1e-4

    def nudge(model, inner):
        for group in inner.param_groups:
            for master in group["params"]:
                master.data.add_(delta)

    _save_layout(tmp_path, 2, 2, 2, zero_stage=1, cfg_args=["--bf16"], mutate=nudge)
    model, optimizer, _, reference = _load_one_process(tmp_path, "--bf16")
    for name, p in model.named_parameters():
        rows = slice(0, 300) if name == "embed.word.weight" else slice(None)
        want = reference[name][rows].float() + delta
        master = optimizer.main_param(p)
        assert master.dtype == torch.float32 and torch.equal(master[rows], want), name
        assert torch.equal(p[rows], want.to(torch.bfloat16)), name
        assert torch.equal(
            optimizer.state[master]["exp_avg"][rows], 2 * reference[name][rows].float()
        ), name
    assert not model.embed.word.weight[300:].any()


def test_same_tp_keeps_each_ranks_state_as_it_was(tmp_path):
    # to TP=2 x PP=1 x DP=1: stages joined, ZeRO shards merged
    _save_layout(tmp_path, 2, 2, 2, zero_stage=1)
    for rank in range(2):
        model, optimizer, _, reference = _load_one_process(tmp_path, tp=2, rank=rank)
        for name, p in model.named_parameters():
            assert torch.equal(p, reference[name]), name  # padding rows included: the same padding
            assert torch.equal(optimizer.state[p]["exp_avg"], 2 * reference[name]), name
            assert optimizer.state[p]["step"] == 7


def test_a_reset_done_before_the_save_keeps_the_optimizer_state_across_a_reshard(tmp_path):
    """reset_optimizer_warmup_iters stays in a run's config after its reset: a later resume on another layout
    loads the optimizer state the reset's run has built up since (a crash before: no state read at all)."""
    done = {"iteration": 4, "warmup_iters": 5, "updates": 5}
    _save_layout(tmp_path, 2, 1, 1, zero_stage=0, optimizer_reset=done)
    model, optimizer, state, reference = _load_one_process(
        tmp_path, "--reset_optimizer_warmup_iters=5"
    )
    assert state.optimizer_reset == done
    fc1 = model.blocks["1"].mlp.fc1.weight
    assert optimizer.state[fc1]["step"] == 7
    assert torch.equal(optimizer.state[fc1]["exp_avg"], 2 * reference["blocks.1.mlp.fc1.weight"])


def test_another_pp_partition_method_moves_the_layers_between_the_stages(tmp_path):
    """The same TP x PP x DP with another pp_partition_method puts other layers on a stage (4 layers on 3
    stages: [0], [1, 2], [3] or [0, 1], [2], [3]): each is found by name, as on another layout (it was a
    strict load_state_dict's missing keys, a traceback)."""
    _save_layout(tmp_path, 1, 3, 1, zero_stage=0)  # type:transformer|embedding
    cfg = arguments.load_config(
        [
            *CFG,
            f"--load={tmp_path}",
            "--pipeline_model_parallel_size=3",
            "--pp_partition_method=type:transformer",
        ]
    )
    arguments.prepare(cfg, 3)
    saved = parallel.grid
    parallel.grid = parallel.Grid(1, 3, world_size=3, rank=0)  # the first stage, on paper
    try:
        model, optimizer, _, reference = _load(cfg)
    finally:
        parallel.grid = saved
    assert sorted(model.blocks) == ["0", "1"]
    for name, p in model.named_parameters():
        assert torch.equal(p, reference[name]), name
        assert torch.equal(optimizer.state[p]["exp_avg"], 2 * reference[name]), name


def test_replicated_copies_that_differ_are_refused(tmp_path):
    def drift(model, optimizer):  # lesson 18: a LayerNorm drifting on one TP rank
        if parallel.grid.tp_rank == 1 and "blocks.0.ln_1.weight" in dict(model.named_parameters()):
            with torch.no_grad():
                model.blocks["0"].ln_1.weight[3] += 1e-3

    _save_layout(tmp_path, 2, 1, 1, zero_stage=0, mutate=drift)
    with pytest.raises(
        ValueError,
        match=r"the weight of 'blocks.0.ln_1.weight' differs between TP rank 0 and TP "
        r"rank 1",
    ):
        _load_one_process(tmp_path)


def test_8bit_states_are_refused_across_a_tp_change(tmp_path):
    pytest.importorskip("bitsandbytes")
    _save_layout(tmp_path, 2, 1, 1, zero_stage=0, cfg_args=["--use_bnb_optimizer"])
    with pytest.raises(ValueError, match="8-bit optimizer states .* tensor_model_parallel_size=2"):
        _load_one_process(tmp_path, "--use_bnb_optimizer")
    model, optimizer, _, reference = _load_one_process(
        tmp_path, "--use_bnb_optimizer", "--no_load_optim"
    )
    assert torch.equal(model.blocks["1"].mlp.fc1.weight, reference["blocks.1.mlp.fc1.weight"])


# -----------------------------------------------------------------------------
# End to end


def _tb_losses(run):
    return {it: v["lm-loss"] for it, v in run.scalars.items()}


def _assert_follows(run, straight, iterations):
    losses = _tb_losses(run)
    assert sorted(losses) == list(iterations), run.out[-2000:]
    for it in iterations:
        a, b = losses[it], _tb_losses(straight)[it]
        assert math.isclose(a, b, rel_tol=1e-5), f"iteration {it}: {a} vs {b} (straight run)"


@pytest.mark.slow
def test_resume_on_other_layouts_follows_the_straight_run(synthetic_corpus, tmp_path):  # noqa: F811
    # ALiBi and the embedding LayerNorm, BLOOM's model, with GPT-2's real vocabulary: padded to 50432 rows at TP=2
    # and to 50304 at TP=1, so the padding is dropped and redone (padded rows are masked out of the softmax).
    # Dropout is off: RNG streams do not survive a layout change.
    args = [
        f"--data_path={synthetic_corpus}",
        "--position_embedding_type=alibi",
        "--train_iters=12",
        "--vocab_size=50257",
    ]
    straight = launch(tmp_path / "straight", 1, *args)
    first = launch(
        tmp_path / "a",
        4,
        *args,
        "--tensor_model_parallel_size=2",
        "--pipeline_model_parallel_size=2",
        f"--save={tmp_path / 'a'}",
        "--exit_interval=6",
    )
    _assert_follows(first, straight, range(1, 7))
    one = launch(tmp_path / "b", 1, *args, f"--load={tmp_path / 'a'}")
    assert "saved with TP=2 x PP=2 x DP=1, now TP=1 x PP=1 x DP=1" in one.out
    _assert_follows(one, straight, range(7, 13))
    # Adam's state split
    dp2 = launch(tmp_path / "c", 2, *args, f"--load={tmp_path / 'a'}", "--zero_stage=1")
    _assert_follows(dp2, straight, range(7, 13))


def test_tied_copies_that_differ_are_refused(tmp_path):
    # lesson 11: the last stage's copy of the tied embedding left behind
    def drift(model, optimizer):
        if parallel.grid.is_last_stage:
            with torch.no_grad():
                model.output_weight[5, 3] += 1e-3

    _save_layout(tmp_path, 1, 2, 1, zero_stage=0, mutate=drift)
    with pytest.raises(
        ValueError,
        match=r"the last stage's copy of the tied word embedding differs from the first "
        r"stage's on TP rank 0 \(lesson 11\)",
    ):
        _load_one_process(tmp_path)


def test_deepspeed_optimizer_state_is_refused_in_both_directions(tmp_path):
    """A checkpoint saved under DeepSpeed (its optimizer state is DeepSpeed's flat buffers) cannot be resharded,
    nor can a checkpoint be resharded into DeepSpeed's optimizer; no_load_optim (and eval_only) take the weights
    alone."""
    _save_layout(tmp_path, 2, 1, 1, zero_stage=0)
    tag_dir = tmp_path / "global_step10"
    with pytest.raises(
        ValueError,
        match="resharding into DeepSpeed's optimizer is not supported: resume with the "
        "saved layout, or set no_load_optim",
    ):
        cfg = arguments.load_config([*CFG, "--deepspeed", "--bf16", "--zero_stage=1"])
        layout = reshard.SavedLayout(str(tag_dir), checkpoint.saved_topology(str(tag_dir)))
        reshard.load(layout, GPT(cfg), None, deepspeed=True)
    for path in tag_dir.glob("mp_rank_*_model_states.pt"):  # as if saved with deepspeed=True
        blob = torch.load(path, weights_only=False)
        blob["run"]["config"]["deepspeed"] = True
        torch.save(blob, path)
    with pytest.raises(
        ValueError,
        match="holds DeepSpeed's optimizer state, which cannot be resharded here; "
        "resume with the saved layout, or set no_load_optim",
    ):
        _load_one_process(tmp_path)
    model, _, _, reference = _load_one_process(tmp_path, "--no_load_optim")
    assert torch.equal(model.blocks["0"].mlp.fc1.weight, reference["blocks.0.mlp.fc1.weight"])
    # eval_only trains nothing: the weights alone, as at the saved layout (it was refused as above)
    model, _, state, reference = _load_one_process(tmp_path, "--eval_only")
    assert torch.equal(model.blocks["0"].mlp.fc1.weight, reference["blocks.0.mlp.fc1.weight"])
    assert state.iteration == 10
