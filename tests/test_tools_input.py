"""The small tools refuse bad input with one message naming the problem and the fix, before any work,
with a non-zero exit and no traceback: each tool's main run in this process on tiny inputs."""

import importlib.util
import json
import os
import re
import sys

import pytest
import torch

from helpers import ROOT, TINY_GPT2, build_tokenizer_file, tool_cli, write_checkpoint

sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_index  # noqa: E402
import check_checkpoint  # noqa: E402
import compare_weight_dumps  # noqa: E402
import cpu_vs_nanogpt  # noqa: E402
import export_hf  # noqa: E402
import plot  # noqa: E402
import sample  # noqa: E402
import show_samples  # noqa: E402

# tools/evaluate.py under another name: as `evaluate` it would stand in for Hugging Face's package
TOOL_SPEC = importlib.util.spec_from_file_location(
    "evaluate_tool", os.path.join(ROOT, "tools", "evaluate.py")
)
evaluate_tool = importlib.util.module_from_spec(TOOL_SPEC)
TOOL_SPEC.loader.exec_module(evaluate_tool)


def refused(main, argv, capsys):
    """main(argv) ends with argparse's error: exit 2, its message the last line; returns it."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bench_index_refuses_sizes_it_cannot_build_and_a_dir_it_cannot_use(
    tmp_path, capsys, monkeypatch
):
    """--mean_doc_tokens 0 and --seq_length 0 were a ZeroDivisionError, --samples -5 ran and exited
    0, a missing --dir or one under a file a traceback from tempfile."""

    def no_corpus(*args):
        raise AssertionError("the corpus was written")

    monkeypatch.setattr(bench_index, "write_synthetic_corpus", no_corpus)
    (tmp_path / "afile").write_text("mine")
    for flags, said in [
        (["--samples=10", "--mean_doc_tokens=0"], "--mean_doc_tokens 0.0 must be above 0"),
        (["--samples=10", "--seq_length=0"], "--seq_length 0 must be at least 1"),
        (["--samples=-5"], "--samples -5 must be at least 1"),
        (["--samples=10", "--corpus_tokens=0"], "--corpus_tokens 0 must be at least 1"),
        (["--samples=10", "--epochs=0"], "--epochs 0.0 must be above 0"),
        (
            ["--samples=10", "--dir", str(tmp_path / "missing")],
            f"--dir {tmp_path / 'missing'} does not exist: give an existing directory",
        ),
        (
            ["--samples=10", "--dir", str(tmp_path / "afile" / "d")],
            f"--dir={tmp_path / 'afile' / 'd'} cannot be created: {tmp_path / 'afile'} is a file",
        ),
    ]:
        line = refused(bench_index.main, flags, capsys)
        assert line.endswith(f": error: {said}") or f": error: {said}" in line, line
    assert os.listdir(tmp_path) == ["afile"]


def test_plot_names_a_run_without_metrics_a_damaged_line_and_a_wrong_label_count(tmp_path, capsys):
    """A run directory without metrics.jsonl was a FileNotFoundError traceback; a line that is no
    JSON an error naming neither file nor line; --labels of another count than the runs was taken
    as far as it went."""
    good = tmp_path / "good"
    good.mkdir()
    (good / "metrics.jsonl").write_text('{"iteration": 1, "lm loss": 5.0, "grad norm": 1.0}\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    out = str(tmp_path / "runs.png")
    for runs, said in [
        (
            [good, empty],
            f"{empty} holds no metrics.jsonl: give a run's save directory (train.py writes "
            "metrics.jsonl there), a metrics.jsonl or a log file",
        ),
        (
            [good, good, "--labels", "a"],
            "--labels gives 1 label(s) for 2 run(s): give one per run, in their order, or none",
        ),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(said)):
            plot.main([*map(str, runs), "--out", out])
    damaged = tmp_path / "damaged" / "metrics.jsonl"
    damaged.parent.mkdir()
    damaged.write_text('{"iteration": 1, "lm loss": 5.0}\n{"iteration": 2, "lm\n{"iteration": 3}\n')
    with pytest.raises(
        ValueError, match="^" + re.escape(f"{damaged} line 2 is not a JSON record (")
    ):
        plot.main([str(damaged.parent), "--out", out])
    assert not os.path.exists(out)
    # a run writing its last line (or killed in it): the line skipped, and said
    writing = tmp_path / "writing" / "metrics.jsonl"
    writing.parent.mkdir()
    writing.write_text('{"iteration": 1, "lm loss": 5.0, "grad norm": 1.0}\n{"iteration": 2, "lm')
    plot.main([str(writing.parent), "--out", out])
    said = capsys.readouterr().out
    assert f"{writing}: its last line is cut short (a run writing it, or killed): skipped" in said
    assert os.path.getsize(out) > 0


def test_compare_weight_dumps_gives_bad_input_exit_2_and_its_own_line(tmp_path, capsys):
    """A missing directory or a file printed "no after-load dumps" and exited 1, the status of
    weights that differ; a dump cut short was a traceback from torch.load."""
    main = compare_weight_dumps.main
    (tmp_path / "afile").write_text("mine")
    dumps = tmp_path / "run" / "weight_dumps"
    dumps.mkdir(parents=True)
    for directory, said in [
        (tmp_path / "missing", "does not exist: give the checkpoint directory of a run trained "),
        (tmp_path / "afile", "is a file: give the checkpoint directory"),
        (tmp_path / "run", "error: no after-load dumps in "),
    ]:
        assert main([str(directory)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    name = "debug-5-pp0-tp0-dp0-global0-{}.pt"
    torch.save({"w": torch.ones(3)}, dumps / name.format("before-save"))
    torch.save({"w": torch.ones(3)}, dumps / name.format("after-load"))
    assert main([str(tmp_path / "run")]) == 0
    capsys.readouterr()
    torch.save({"w": torch.zeros(3)}, dumps / name.format("after-load"))
    assert main([str(tmp_path / "run")]) == 1  # weights that differ: 1, not 2
    capsys.readouterr()
    after = dumps / name.format("after-load")
    after.write_bytes(after.read_bytes()[:100])  # a kill while the dump was written
    assert main([str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {after} cannot be read (") and err.count("\n") == 1, err
    assert "a dump cut short, or not one; remove it or dump again" in err


def not_read(*args, **kwargs):
    raise AssertionError("the input was read before the flags were checked")


def test_sample_refuses_what_it_cannot_sample_before_reading_the_checkpoint(capsys, monkeypatch):
    """--num_samples -1 (or 0) printed nothing and exited 0; the other flags shared one message that
    named none of them, and a nan temperature sampled."""
    monkeypatch.setattr(sample, "load_model", not_read)
    for flag, said in [
        ("--num_samples=-1", "--num_samples -1 must be at least 1"),
        ("--num_samples=0", "--num_samples 0 must be at least 1"),
        ("--max_tokens=-1", "--max_tokens -1 must be 0 or more"),
        ("--temperature=0", "--temperature 0.0 must be above 0"),
        ("--temperature=nan", "--temperature nan must be above 0"),
        ("--top_k=-2", "--top_k -2 must be 0 (all tokens) or more"),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(said) + "$"):
            sample.main(["--load", "nowhere", flag])
    proc = tool_cli("sample.py", "--load", "nowhere", "--num_samples", "-1")
    assert (proc.returncode, proc.stderr) == (2, "error: --num_samples -1 must be at least 1\n")


def test_a_runs_tokenizer_file_not_here_is_refused_before_the_gather_and_can_be_given(
    tmp_path, monkeypatch, capsys
):
    """A checkpoint whose run's tokenizer_file is not on this machine (trained elsewhere) was
    refused once the whole model was gathered, and sample and evaluate had no flag to say where
    it is here: the checkpoint could not be used at all."""
    missing = tmp_path / "elsewhere" / "tokenizer.json"
    ckpt = str(tmp_path / "ckpt")
    write_checkpoint(
        ckpt, [*TINY_GPT2, "--vocab_size=400", f"--tokenizer_file={missing}"], lambda s: 0
    )
    said = (
        f"^the run's tokenizer_file {re.escape(str(missing))} is not on this machine: give "
        "--tokenizer_file its path here$"
    )
    with monkeypatch.context() as m:
        m.setattr(sample.reshard, "load_full_model", not_read)
        for main in (
            lambda: sample.main(["--load", ckpt]),
            lambda: evaluate_tool.eval_harness.StableGPT.from_checkpoint(ckpt),
        ):
            with pytest.raises(FileNotFoundError, match=said):
                main()
        assert export_hf.run(["--load", ckpt, "--output", str(tmp_path / "hf")]) == 2
        assert re.match(said[1:-1], capsys.readouterr().err[len("error: ") :])
    here = build_tokenizer_file(tmp_path / "tokenizer.json")
    sample.main(["--load", ckpt, "--tokenizer_file", here, "--max_tokens=4", "--prompt=ROMEO:"])
    assert capsys.readouterr().out.startswith("ROMEO:")
    lm = evaluate_tool.eval_harness.StableGPT.from_checkpoint(ckpt, tokenizer_file=here)
    assert lm.tok.path == here
    assert (
        evaluate_tool.parse(
            ["--load", ckpt, "--tasks=t", f"--tokenizer_file={here}"]
        ).tokenizer_file
        == here
    )


def test_evaluate_refuses_a_tokenizer_of_more_ids_than_the_model_before_the_gather(
    tmp_path, monkeypatch
):
    """GPT-2's 50257 ids over a 128-token model were refused once the whole model was gathered."""
    write_checkpoint(str(tmp_path / "ckpt"), TINY_GPT2, lambda s: 0)
    monkeypatch.setattr(evaluate_tool.eval_harness.reshard, "load_full_model", not_read)
    with pytest.raises(
        ValueError,
        match="^the tokenizer \\(GPT-2 BPE: the run named no tokenizer_file\\) has 50257 ids but the model only 128: ",
    ):
        evaluate_tool.eval_harness.StableGPT.from_checkpoint(str(tmp_path / "ckpt"))


def test_sample_refuses_a_tokenizer_of_more_ids_than_the_model_before_the_gather(
    tmp_path, monkeypatch
):
    """GPT-2's ids over a 128-token model were an IndexError traceback from the embedding, after
    the gather."""
    write_checkpoint(str(tmp_path / "ckpt"), TINY_GPT2, lambda s: 0)
    monkeypatch.setattr(sample.reshard, "load_full_model", not_read)
    said = "the tokenizer (GPT-2 BPE: the run named no tokenizer_file) has 50257 ids but the model "
    with pytest.raises(ValueError, match="^" + re.escape(said) + "only 128: "):
        sample.main(["--load", str(tmp_path / "ckpt")])


def test_evaluate_refuses_log_samples_without_a_file_to_write_them_to():
    """--log_samples without --output_path computed each document's answers and dropped them."""
    with pytest.raises(ValueError, match="^--log_samples .* give --output_path too$"):
        evaluate_tool.parse(["--load", "x", "--tasks", "t", "--log_samples", "--device=cpu"])


def test_evaluate_refuses_tasks_that_name_no_task():
    """--tasks , (or "") gathered the model, then lm-eval said "No tasks specified"."""
    for tasks in (",", ""):
        with pytest.raises(ValueError, match=f"^--tasks '{tasks}' names no task: give "):
            evaluate_tool.parse(["--load", "x", "--tasks", tasks, "--device=cpu"])


def test_show_samples_refuses_a_negative_max_chars(monkeypatch):
    """--max_chars -1 was a slice's end: each text cut by one character, in silence."""
    monkeypatch.setattr(show_samples.arguments, "load_config", not_read)
    with pytest.raises(ValueError, match="^--max_chars -1 must be 0 \\(headers only\\) or more$"):
        show_samples.main(["--iterations", "1-2", "--max_chars=-1"])


def test_show_samples_names_a_missing_tokenizer_file_before_the_data(tmp_path):
    """A tokenizer_file that is not there was a FileNotFoundError traceback, after the data's
    sample index was built."""
    missing = tmp_path / "tokenizer.json"
    proc = tool_cli(
        "show_samples.py",
        "--iterations=1-1",
        *TINY_GPT2,
        f"--data_path={tmp_path / 'no_corpus'}",  # read after the tokenizer: not reached
        f"--tokenizer_file={missing}",
        f"--save={tmp_path / 'run'}",
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"error: tokenizer_file {missing} not found; "), proc.stderr


def test_a_file_given_for_the_checkpoint_directory_is_called_a_file(tmp_path, capsys):
    """sample, evaluate, export_hf and check_checkpoint said a file given for --load "does not
    exist"."""
    afile = tmp_path / "latest"
    afile.write_text("global_step1\n")
    said = (
        f"{afile} is a file, not a checkpoint directory: give the directory the run saved its "
        "checkpoints into (it holds the 'latest' file)"
    )
    for main in (
        lambda: sample.main(["--load", str(afile)]),
        lambda: evaluate_tool.main(["--load", str(afile), "--tasks", "t", "--device=cpu"]),
        lambda: check_checkpoint.main([str(afile)]),
    ):
        with pytest.raises(ValueError, match="^" + re.escape(said) + "$"):
            main()
    assert export_hf.run(["--load", str(afile), "--output", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == f"error: {said}\n"
    assert sorted(os.listdir(tmp_path)) == ["latest"]


def test_check_checkpoint_names_a_manifest_that_is_not_ours(tmp_path):
    """A manifest whose topology lacks its sizes, or a file entry its checksum, was a KeyError
    traceback."""
    tag_dir = write_checkpoint(str(tmp_path / "ckpt"), TINY_GPT2, lambda stage: None)
    path = os.path.join(tag_dir, "manifest.json")
    whole = json.load(open(path))
    sizes = "tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size"
    name = sorted(whole["files"])[0]
    for manifest, problem in [
        ({**whole, "topology": {}}, f"its topology does not give {sizes} (each 1 or more)"),
        (
            {**whole, "topology": {"tensor_model_parallel_size": 1}},
            f"its topology does not give {sizes} (each 1 or more)",
        ),
        (
            {**whole, "files": {**whole["files"], name: {"bytes": whole["files"][name]["bytes"]}}},
            "an entry of its 'files' has no 'bytes' or no 'crc32'",
        ),
    ]:
        with open(path, "w") as f:
            json.dump(manifest, f)
        said = f"checkpoint manifest {path} cannot be read (ValueError: {problem}); the checkpoint "
        with pytest.raises(ValueError, match="^" + re.escape(said) + "is damaged -- "):
            check_checkpoint.main([str(tmp_path / "ckpt")])


def test_export_hf_refuses_a_model_it_cannot_export_before_the_gather(
    tmp_path, capsys, monkeypatch
):
    """The whole model was gathered (every weight read) before padded_vocab_in_softmax was
    refused."""
    write_checkpoint(
        str(tmp_path / "ckpt"), [*TINY_GPT2, "--padded_vocab_in_softmax=true"], lambda s: 0
    )
    monkeypatch.setattr(export_hf.reshard, "load_full_model", not_read)
    output = tmp_path / "hf"
    assert export_hf.run(["--load", str(tmp_path / "ckpt"), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: cannot export padded_vocab_in_softmax=True: ")
        and err.count("\n") == 1
    ), err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_export_hf_refuses_a_missing_tokenizer_file_before_the_gather(
    tmp_path, capsys, monkeypatch
):
    """A --tokenizer_file that is not there (or the checkpoint's own, on another machine) was
    refused once the whole model was gathered, every weight read."""
    write_checkpoint(str(tmp_path / "ckpt"), TINY_GPT2, lambda s: 0)
    monkeypatch.setattr(export_hf.reshard, "load_full_model", not_read)
    missing = tmp_path / "tokenizer.json"
    output = tmp_path / "hf"
    argv = ["--load", str(tmp_path / "ckpt"), "--output", str(output)]
    assert export_hf.run([*argv, "--tokenizer_file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: tokenizer_file {missing} not found; ") and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_cpu_vs_nanogpt_refuses_what_it_cannot_time_before_the_first_measurement(
    tmp_path, capsys, monkeypatch
):
    """A --trees without bench.py was a traceback after the trees before it were measured;
    --rounds 0 and --steps 0 a StatisticsError after the rounds."""

    def measured(*args):
        raise AssertionError("a measurement ran")

    monkeypatch.setattr(cpu_vs_nanogpt, "measure", measured)
    for flags, said in [
        (
            [
                "--trees",
                ROOT,
                str(tmp_path),
            ],  # the first one whole: all are checked before any runs
            f"--trees {tmp_path} has no bench.py: give the root of a stablegpt checkout "
            "(git worktree add DIR COMMIT makes one)",
        ),
        (["--rounds=0"], "--rounds 0 must be at least 1"),
        (["--steps=0"], "--steps 0 must be at least 1"),
        (["--threads=0"], "--threads 0 must be at least 1"),
        (["--num_layers=-1"], "--num_layers -1 must be at least 1"),
        (["--warmup=-1"], "--warmup -1 must be 0 or more"),
        (["--trees", "--no-nanogpt"], "--trees names no checkout and --no-nanogpt drops nanoGPT: "),
    ]:
        line = refused(cpu_vs_nanogpt.main, flags, capsys)
        assert f": error: {said}" in line, line
