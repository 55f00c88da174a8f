"""The spike guard's snapshots: how far back they reach, the host copies, and their host memory in the dry run."""
import re
import types

import pytest
import torch

import arguments
import snapshots
import spike_guard

SCALER = types.SimpleNamespace(dynamic=False, scale=1.0, min_scale=1.0)


def test_snapshots_reach_back_two_rewinds_and_an_interval(monkeypatch):
    """Strikes at 1049, 1100 and 1149 (rewind 100, a snapshot every 50, no save) roll back to before 949."""
    cfg = arguments.load_config(["--spike_guard", "--spike_guard_window=16", "--spike_guard_min_steps=8",
                                 "--spike_guard_rewind=100", "--spike_guard_snapshot_interval=50",
                                 "--spike_guard_skip_after=20", "--spike_guard_max_skips=3"])
    guard = spike_guard.SpikeGuard(cfg)
    assert snapshots.keep(cfg) == 5
    monkeypatch.setattr(snapshots.run_state, "capture", lambda parts: {"iteration": parts})
    store = snapshots.Snapshots(cfg)
    decision = None
    for it in range(1, 1150):
        if it in (1049, 1100, 1149):
            decision = guard.update(it, "nan", float("nan"), 1.0, SCALER)
        store.maybe_take(it, it)
    assert decision["action"] == "rollback" and decision["start"] == 949
    assert [it for it, *_ in store.items] == [900, 950, 1000, 1050, 1100]
    found, payload = store.newest_before(decision["start"])
    assert found == 900 and payload == {"iteration": 900}


def test_host_copy_is_a_copy_and_reuses_a_spare_only_on_cuda():
    live = {"w": torch.ones(3), "opt": [torch.zeros(2, 2), 5], "rng": (1, 2)}
    copy, event = snapshots.host_copy(live)
    assert event is None and torch.equal(copy["w"], live["w"]) and copy["opt"][1] == 5 and copy["rng"] == (1, 2)
    live["w"].add_(1)
    assert copy["w"].tolist() == [1.0, 1.0, 1.0]  # not aliased


@pytest.mark.cuda
def test_host_copy_of_cuda_tensors_is_pinned_non_blocking_and_reuses_the_spare():
    live = {"w": torch.randn(1024, 1024, device="cuda"), "step": torch.tensor(3.0)}
    first, event = snapshots.host_copy(live)
    event.synchronize()
    assert first["w"].is_pinned() and torch.equal(first["w"], live["w"].cpu())
    buffer = first["w"].data_ptr()
    live["w"].mul_(2)
    second, event = snapshots.host_copy(live, spare=first)
    event.synchronize()
    assert second["w"].data_ptr() == buffer and torch.equal(second["w"], live["w"].cpu())


def test_the_dry_run_reports_the_snapshots_host_memory(capsys):
    import estimate
    cfg = arguments.load_config(["config/tr11_176b.py", "--spike_guard"])
    assert snapshots.keep(cfg) == 5  # rewind 100, a snapshot every 50
    # bf16: 2 bytes of weights and 12 of fp32 masters and Adam's moments per parameter, sharded over DP (ZeRO-1)
    assert snapshots.snapshot_bytes(cfg, 10**9, 8) == 5 * 10**9 * (2 + 12 / 8)
    cfg = arguments.load_config(["--num_layers=2", "--hidden_size=64", "--num_attention_heads=4", "--spike_guard",
                                 "--spike_guard_rewind=10", "--spike_guard_snapshot_interval=5"])
    estimate.dry_run(cfg)
    assert re.search(r"spike guard snapshots: 5 x \d\.\d\d GiB = \d\.\d\d GiB of host memory per GPU",
                     capsys.readouterr().out)
