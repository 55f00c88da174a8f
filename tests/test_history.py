"""The loss history (stability/history.py): kept by the stability layer's callback that the soft
skip and the spike guard read, not by the run state; checkpoints carry it, and a resume -- from a
checkpoint of this version, or of one whose run state kept it (checkpoint.MOVED) -- goes on
bit-exactly."""
import re
import shutil

import pytest
import torch

import checkpoint
import parallel
from helpers import SMALL, corpus, corpus512, losses, run_main  # noqa: F401 (corpus, corpus512: fixtures)

# the soft skip acting on the steps above its trend (the history's line), from iteration 3 on
# (a high LR: a loss that overshoots its line after the resume, at iterations 7 and 8)
ARGS = [*SMALL, "--eval_iters=0", "--soft_skip_loss_ratio=1", "--spike_guard_min_steps=2", "--lr=0.05"]


def _old_format(directory):
    """The checkpoint `latest` names rewritten as a version before #49 wrote it: the history in
    the run state."""
    tag_dir = checkpoint.latest_dir(str(directory))
    g = parallel.Grid(world_size=1)
    blob = torch.load(checkpoint.model_file(tag_dir, g), weights_only=False)
    rank = torch.load(checkpoint.rank_file(tag_dir, g), weights_only=False)
    state = blob["run"]["state"]
    state["history"] = state["callbacks"].pop("history")
    entries = checkpoint.write_files(tag_dir, blob["model"], blob["run"], rank, True, g)
    checkpoint.write_manifest(tag_dir, [entries], g)


@pytest.mark.slow  # 4 short runs of the SMALL model, about 25 s on 2 cores
def test_a_resume_goes_on_with_the_history_bit_exactly_from_a_new_or_an_old_checkpoint(corpus, tmp_path):
    args = [*ARGS, f"--data_path={corpus}"]
    out = run_main(*args, "--train_iters=8")
    straight, scaled = losses(out), re.findall(r"^soft skip: .*", out, re.M)
    assert len(scaled) == 2, out[-3000:]  # after the resume point: the history decides them
    run_main(*args, "--train_iters=4", f"--save={tmp_path / 'new'}", "--save_interval=4")
    state = torch.load(tmp_path / "new" / "global_step4" / "mp_rank_00_000_model_states.pt", weights_only=False)
    assert "history" not in state["run"]["state"]
    assert len(state["run"]["state"]["callbacks"]["history"]["loss"]) == 4  # its own state
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    _old_format(tmp_path / "old")
    for kind in ("new", "old"):
        out = run_main(*args, "--train_iters=8", f"--save={tmp_path / kind}", "--save_interval=100")
        assert {i: v for i, v in losses(out).items() if i > 4} == {i: straight[i] for i in (5, 6, 7, 8)}, kind
        assert re.findall(r"^soft skip: .*", out, re.M) == scaled, kind
        assert ("run state: history moved to the stability layer's" in out) == (kind == "old")


def test_without_the_soft_skip_or_the_guard_no_history_is_kept(corpus512, tmp_path):
    run_main(*SMALL, "--eval_iters=0", "--vocab_size=512", f"--data_path={corpus512}", "--train_iters=2",
             f"--save={tmp_path}", "--save_interval=2")
    state = torch.load(tmp_path / "global_step2" / "mp_rank_00_000_model_states.pt", weights_only=False)
    assert "history" not in state["run"]["state"] and "history" not in state["run"]["state"]["callbacks"]
