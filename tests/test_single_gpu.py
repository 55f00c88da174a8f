"""Every single-process `python train.py config/...` command of README.md and docs/gpu.md passes its dry run with
one process (the layout fits one GPU: tr3_1b3.py's PP=2 did not, "world size 1 is not divisible by ..."), and
config/tr3_1b3_1gpu.py is config/tr3_1b3.py's run with one GPU's layout and memory knobs. Cheap: the meta device."""

import io
import os
import re
import shlex

import pytest

import arguments
import estimate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = re.compile(r"(?<![\w=])python train\.py (config/\S+\.py[^`#\n]*)")


def single_gpu_commands():
    found = []
    for doc in ("README.md", os.path.join("docs", "gpu.md")):
        with open(os.path.join(ROOT, doc)) as f:
            for line in f:
                if "torchrun" in line or "WORLD_SIZE=" in line or "init_from_hf" in line:
                    continue  # several processes; a Hugging Face model of the user's
                found += [(doc, m.group(1).strip()) for m in COMMAND.finditer(line)]
    return found


def test_the_docs_name_both_single_gpu_configs():
    configs = {shlex.split(command)[0] for _, command in single_gpu_commands()}
    assert {"config/gpt2_125m.py", "config/tr3_1b3_1gpu.py"} <= configs, configs


@pytest.mark.parametrize("doc,command", single_gpu_commands())
def test_a_single_gpu_command_passes_its_dry_run_with_one_process(doc, command, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = arguments.load_config(shlex.split(command) + ["--dry_run"])
    out = io.StringIO()
    sizes = estimate.dry_run(cfg, world_size=1, file=out)
    assert "= 1 GPUs" in out.getvalue() and sizes["dp"] == 1
    # the configs chosen for one 80 GB GPU fit with room to spare
    if "1gpu" in command or "gpt2_125m" in command:
        activations = sizes[
            "activations_checkpointed" if cfg.checkpoint_activations else "activations"
        ]
        assert (sizes["model_states"] + activations) / 2**30 < 60, out.getvalue()


def test_the_one_gpu_config_is_the_runs_config_with_one_gpus_layout():
    run = arguments.load_config([os.path.join(ROOT, "config", "tr3_1b3.py")])
    one = arguments.load_config([os.path.join(ROOT, "config", "tr3_1b3_1gpu.py")])
    machine = {
        "pipeline_model_parallel_size",
        "pp_partition_method",  # one stage: left out, at its default
        "zero_stage",
        "micro_batch_size",
        "checkpoint_activations",
        "save",
        "load",
    }
    differ = {k for k in arguments.to_dict(run) if getattr(run, k) != getattr(one, k)}
    assert differ == machine, differ ^ machine
    assert (one.pipeline_model_parallel_size, one.micro_batch_size, one.checkpoint_activations) == (
        1,
        8,
        False,
    )
    with pytest.raises(ValueError, match="world size 1 is not divisible"):
        arguments.prepare(run, 1, reads_data=False)  # the run's own layout needs its GPUs


def test_gpu_check_script_parses_and_says_no_gpu_in_one_line():
    import subprocess

    script = os.path.join(ROOT, "tools", "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a machine with one
    proc = subprocess.run(["bash", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and proc.stdout.strip().splitlines()[-1].startswith(
        "verdict: FAIL -- torch sees no"
    )
