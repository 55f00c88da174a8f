"""Tokens/s and MFU in the training log line, metrics.jsonl, TensorBoard and wandb
(report.Report.log): the model's own FLOPs as bench.py counts them
(GPTConfig.model_flops_per_iteration) over the device's datasheet peak (report.GPU_PEAKS, bench.py's
table); "MFU n/a" where there is no peak (the CPU)."""

import json
import types

import pytest
import torch

import arguments
import report
from helpers import plan_of
from model import GPTConfig
from sections import section


class Model(torch.nn.Module):
    """What Report reads of a model: its config (FLOPs) and where its parameters are (the peak)."""

    def __init__(self, cfg):
        super().__init__()
        self.config = section(GPTConfig, cfg)
        self.weight = torch.nn.Parameter(torch.zeros(1))


class Writer:
    """TensorBoard's SummaryWriter and wandb's run, as far as Report uses them."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, key, value, step):
        self.scalars.setdefault(key, value)

    def log(self, values):  # no step: wandb drops one below its last (report.Report.scalars)
        self.scalars.update(values)


def log_once(tmp_path, capsys, peak):
    """One iteration of 0.5 s logged by a Report on a tiny config: (log line, metrics.jsonl record,
    TensorBoard's scalars, wandb's, model FLOPs of the iteration, tokens of it)."""
    cfg = arguments.load_config(["config/tiny.py", "--log_interval=1", "--train_iters=2"])
    arguments.prepare(cfg, 1)
    reporter = report.Report(section(report.LoggingConfig, cfg), plan_of(cfg), Model(cfg))
    reporter.peak = peak
    reporter.metrics = report.MetricsFile(str(tmp_path / "metrics.jsonl"))
    reporter.tb, reporter.wandb = {"iterations": Writer()}, Writer()
    step = types.SimpleNamespace(loss=2.0, outcome="ok", grad_norm=1.0, num_zeros=0.0, z_loss=None)
    state = types.SimpleNamespace(
        consumed_samples=cfg.global_batch_size,
        consumed_tokens=cfg.global_batch_size * cfg.seq_length,
    )
    reporter.step(step, 1e-3)
    reporter.timed(0.5)
    capsys.readouterr()
    reporter.log(1, state, cfg.global_batch_size, cfg.seq_length, 1.0)
    reporter.metrics.close()
    line = capsys.readouterr().out.strip()
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    flops = reporter.gpt.config.model_flops_per_iteration(cfg.global_batch_size, cfg.seq_length)
    return (
        line,
        record,
        reporter.tb["iterations"].scalars,
        reporter.wandb.scalars,
        flops,
        cfg.global_batch_size * cfg.seq_length,
    )


def test_the_cpu_line_says_mfu_n_a_and_gives_tokens_per_second(tmp_path, capsys):
    line, record, tb, wandb, _, tokens = log_once(
        tmp_path, capsys, report.peak_flops(torch.device("cpu"))
    )
    assert line.endswith(f" tokens per second: {tokens / 0.5:.1f} | MFU: n/a |"), line
    assert record["tokens per second"] == pytest.approx(tokens / 0.5) and record["MFU"] is None
    assert tb["tokens-per-second"] == wandb["tokens-per-second"] == pytest.approx(tokens / 0.5)
    assert "mfu" not in tb and "mfu" not in wandb  # no made-up number where there is no peak


def test_a_gpu_line_divides_the_model_flops_by_the_datasheet_peak(tmp_path, capsys):
    peak = report.gpu_peaks("NVIDIA H200")[0] * 1e12
    line, record, tb, wandb, flops, _ = log_once(tmp_path, capsys, peak)
    mfu = flops / (0.5 * peak)  # one process: bench.py's numbers() for the same iteration
    assert line.endswith(f" MFU: {100 * mfu:.2f}% |"), line
    assert record["MFU"] == pytest.approx(round(100 * mfu, 2))
    assert tb["mfu"] == wandb["mfu"] == pytest.approx(mfu)


def test_the_peak_is_the_datasheet_s_for_a_listed_gpu_and_none_otherwise(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert report.peak_flops(torch.device("cuda", 0)) == 756e12  # the PCIe part, not the SXM's 989
    monkeypatch.setattr(
        torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090"
    )
    assert report.peak_flops(torch.device("cuda", 0)) is None
    assert report.peak_flops(torch.device("cpu")) is None
