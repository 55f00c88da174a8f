"""eval_harness.StableGPT and tools/evaluate.py: a TP=2 x PP=2 checkpoint evaluated on three local tasks
(tests/data/eval_tasks: multiple choice, rolling perplexity, greedy generation) scores what lm-eval's own
transformers backend (HFLM) scores on the checkpoint's Hugging Face export, document by document; the command
line writes the same numbers; a missing checkpoint or an unknown task stops with one message. Nothing downloads:
the tasks read local JSONL files, the datasets cache lives under the test's tmp_path.

Inside a run (eval_harness_tasks): a TP=2 x PP=2 job logs, per task, what the command scores on its
checkpoint; the evaluation leaves the training's losses as they were; task names, task files that do
not parse, keys without tasks and a model too large to gather are refused before training."""

import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from helpers import ROOT, corpus, run_python, write_checkpoint  # noqa: E402,F401 (corpus: a fixture)

sys.path.insert(0, os.path.join(ROOT, "tools"))
import export_hf  # noqa: E402

# tools/evaluate.py under another name: as `evaluate` it would stand in for Hugging Face's evaluate package
TOOL_SPEC = importlib.util.spec_from_file_location(
    "evaluate_tool", os.path.join(ROOT, "tools", "evaluate.py")
)
evaluate_tool = importlib.util.module_from_spec(TOOL_SPEC)
TOOL_SPEC.loader.exec_module(evaluate_tool)

TASKS = os.path.join(ROOT, "tests", "data", "eval_tasks")
NAMES = ["stablegpt_choice", "stablegpt_text", "stablegpt_answer"]
# the export, both models and lm-eval's runs, made once: ~25 s on 2 busy cores
SLOW = pytest.mark.slow
# GPT-2 without the embedding LayerNorm (a GPT2LMHeadModel export), GPT-2's vocabulary (the run's tokenizer), a
# context of 32 tokens (the longest text spans several rolling windows); weights drawn with std 0.3 so that the
# choices' log-likelihoods are far apart and the generations not all empty.
ARGS = [
    "--num_layers=2",
    "--hidden_size=64",
    "--num_attention_heads=4",
    "--seq_length=32",
    "--vocab_size=50257",
    "--activation=gelu_tanh",
    "--embed_layernorm=false",
    "--init_method_std=0.3",
    "--tensor_model_parallel_size=2",
    "--pipeline_model_parallel_size=2",
]


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """No hub access, the datasets cache in a temporary folder, lm-eval's relative data_files read from ROOT."""
    import datasets.config

    patch = pytest.MonkeyPatch()
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        patch.setenv(name, "1")
    patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
    patch.chdir(ROOT)
    yield
    patch.undo()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, offline):
    """(a TP=2 x PP=2 checkpoint written as its 4 ranks would, its transformers export)."""
    tmp = tmp_path_factory.mktemp("evaluate")
    # the model's own init, any layout
    write_checkpoint(str(tmp / "ckpt"), ARGS, fill=lambda stage: None)
    diff, hf, _ = export_hf.export(str(tmp / "ckpt"), str(tmp / "hf"))
    assert diff <= 1e-5 and type(hf).__name__ == "GPT2LMHeadModel"
    return str(tmp / "ckpt"), str(tmp / "hf")


@pytest.fixture(scope="module")
def ours(checkpoint):
    """(our adapter on the checkpoint, 3 requests per batch; lm-eval's results of it with each document's answers)."""
    import eval_harness

    lm = eval_harness.StableGPT.from_checkpoint(checkpoint[0], batch_size=3)
    manager = eval_harness.task_manager(TASKS, True)
    return lm, eval_harness.evaluate(lm, NAMES, manager, log_samples=True)


@pytest.fixture(scope="module")
def theirs(checkpoint):
    """The same of lm-eval's transformers backend, HFLM, on the export."""
    pytest.importorskip(
        "accelerate",
        reason="lm-eval's transformers backend (HFLM) needs accelerate: pip install 'lm-eval[hf]'",
    )
    from lm_eval.models.huggingface import HFLM

    import eval_harness

    lm = HFLM(pretrained=checkpoint[1], device="cpu", dtype="float32", batch_size=3)
    manager = eval_harness.task_manager(TASKS, True)
    return lm, eval_harness.evaluate(lm, NAMES, manager, log_samples=True)


def per_document(results, task):
    return {s["doc_id"]: s["resps"] for s in results["samples"][task]}


@SLOW
def test_loglikelihoods_equal_lm_evals_transformers_backend_per_document(ours, theirs):
    ours, theirs = ours[1], theirs[1]
    for task in ("stablegpt_choice", "stablegpt_text"):
        a, b = per_document(ours, task), per_document(theirs, task)
        assert sorted(a) == sorted(b) and len(a) >= 3
        for doc in a:
            mine = [r[0][0] if task == "stablegpt_choice" else r[0] for r in a[doc]]
            hfs = [r[0][0] if task == "stablegpt_choice" else r[0] for r in b[doc]]
            # measured: <= 7.6e-6
            assert mine == pytest.approx(hfs, rel=1e-6, abs=1e-5), (task, doc)
            if task == "stablegpt_choice":
                assert [r[0][1] for r in a[doc]] == [r[0][1] for r in b[doc]]  # is-greedy flags
                gaps = [abs(x - y) for i, x in enumerate(mine) for y in mine[i + 1 :]]
                assert min(gaps) > 1e-2, (
                    "choices too close for acc to be decided by the model, not rounding"
                )
    for metric in ("acc,none", "acc_norm,none"):
        assert (
            ours["results"]["stablegpt_choice"][metric]
            == theirs["results"]["stablegpt_choice"][metric]
        )
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["stablegpt_text"][metric] == pytest.approx(
            theirs["results"]["stablegpt_text"][metric], rel=1e-5
        )


def test_the_longest_text_spans_several_windows():
    import tokenizer

    text = json.loads(open(os.path.join(TASKS, "text.jsonl")).readlines()[1])["text"]
    # at least 4 windows of seq_length 32
    assert len(tokenizer.get_tokenizer().encode_ordinary(text)) > 3 * 32


@SLOW
def test_greedy_generations_equal_lm_evals_transformers_backend(ours, theirs):
    ours, theirs = ours[1], theirs[1]
    a, b = per_document(ours, "stablegpt_answer"), per_document(theirs, "stablegpt_answer")
    assert a == b
    assert any(r[0][0] for r in a.values()), (
        "every generation empty: the stop strings decided nothing"
    )
    assert ours["results"]["stablegpt_answer"] == theirs["results"]["stablegpt_answer"]


@SLOW
def test_generation_stops_where_lm_evals_transformers_backend_stops(ours, theirs):
    """Stop strings taken from the middle of the model's own greedy text, so that they are met: each generation
    is cut where HFLM cuts it, in a batch of prompts of different lengths (right padding) with one prompt
    truncated on the left (longer than seq_length - max_gen_toks)."""
    from lm_eval.api.instance import Instance

    ours, theirs = ours[0], theirs[0]
    prompts = ["Q: What is the capital of France?\nA:", "Once", "ROMEO: But soft, what light " * 6]

    def generate(lm, kwargs):
        return lm.generate_until(
            [Instance("generate_until", {}, (p, kwargs), i) for i, p in enumerate(prompts)]
        )

    free = generate(ours, {"until": [], "max_gen_toks": 12, "do_sample": False})
    assert free == generate(theirs, {"until": [], "max_gen_toks": 12, "do_sample": False})
    stops = [text[len(text) // 2 : len(text) // 2 + 3] for text in free]
    assert all(len(s) == 3 for s in stops)
    cut = generate(ours, {"until": stops, "max_gen_toks": 12, "do_sample": False})
    assert cut == generate(theirs, {"until": stops, "max_gen_toks": 12, "do_sample": False})
    assert all(len(c) < len(f) for c, f in zip(cut, free))


@SLOW
def test_an_empty_context_continues_from_the_end_of_document(ours):
    """As GPT.generate (top-1: greedy) from the end-of-document id alone, as tools/sample.py starts."""
    from lm_eval.api.instance import Instance

    lm, eot = ours[0], ours[0].eot_token_id
    text = lm.generate_until(
        [Instance("generate_until", {}, ("", {"until": [], "max_gen_toks": 6}), 0)]
    )[0]
    ids = lm.model.generate(torch.tensor([[eot]]), 6, top_k=1)[0, 1:].tolist()
    assert text == lm.tok.decode(ids[: ids.index(eot)] if eot in ids else ids) and text


@SLOW
def test_the_command_writes_lm_evals_results(checkpoint, ours, tmp_path, capsys):
    out = tmp_path / "results.json"
    evaluate_tool.main(
        [
            "--load",
            checkpoint[0],
            "--tasks",
            "stablegpt_cho*",
            "--include_path",
            TASKS,
            "--only_include_path",
            "--batch_size",
            "2",
            "--output_path",
            str(out),
        ]
    )
    written = json.load(open(out))
    assert (
        written["results"]["stablegpt_choice"]["acc,none"]
        == ours[1]["results"]["stablegpt_choice"]["acc,none"]
    )
    # the glob's
    assert list(written["results"]) == ["stablegpt_choice"] and written["config"]["batch_size"] == 2
    assert "stablegpt_choice" in capsys.readouterr().out  # lm-eval's table


def test_an_unknown_task_or_a_missing_checkpoint_is_one_message(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="unknown task.*stablegpt_nothing.*--include_path"):
        evaluate_tool.main(
            [
                "--load",
                checkpoint[0],
                "--tasks",
                "stablegpt_choice,stablegpt_nothing",
                "--include_path",
                TASKS,
                "--only_include_path",
            ]
        )
    proc = subprocess.run(
        [
            sys.executable,
            "tools/evaluate.py",
            "--load",
            str(tmp_path / "nowhere"),
            "--tasks",
            "hellaswag",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        proc.returncode == 2
        and proc.stderr.strip()
        == f"error: checkpoint directory {tmp_path / 'nowhere'} does not exist"
    )
    with pytest.raises(ValueError, match="holds no checkpoint"):
        evaluate_tool.main(
            [
                "--load",
                str(tmp_path),
                "--tasks",
                "stablegpt_choice",
                "--include_path",
                TASKS,
                "--only_include_path",
            ]
        )


def test_a_device_this_machine_lacks_is_refused_before_the_checkpoint_is_read(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def loaded(*args, **kwargs):
        raise AssertionError("the checkpoint was read before --device was checked")

    monkeypatch.setattr(evaluate_tool.eval_harness, "task_manager", loaded)
    monkeypatch.setattr(evaluate_tool.eval_harness.StableGPT, "from_checkpoint", loaded)
    for device, said in (
        ("cuda", "device=cuda but this torch .* or use --device=cpu"),
        ("cuda:1", "device=cuda but"),
        ("gpu", "--device gpu is not a device; give cpu, cuda or cuda:N"),
    ):
        with pytest.raises(ValueError, match=said):
            evaluate_tool.main(
                ["--load", str(tmp_path), "--tasks", "stablegpt_choice", "--device", device]
            )
    assert evaluate_tool.parse(["--load", "x", "--tasks", "t"]).device == "cpu"  # auto, no CUDA


def test_the_adapter_imports_lm_eval_only_when_it_is_used():
    """arguments.py imports eval_harness for its keys (and train.py for the run's evaluation): the
    module itself imports nothing of lm-eval, which costs seconds; StableGPT and the tasks import it
    when they are used. (A run without eval_harness_tasks loading none of it:
    tests/test_structure.py.)"""
    tree = ast.parse(open(os.path.join(ROOT, "eval_harness.py")).read())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top if isinstance(n, ast.ImportFrom)]
    assert "torch" in names and not [m for m in names if m.split(".")[0] == "lm_eval"], names


# -----------------------------------------------------------------------------
# Inside a run: eval_harness_tasks every eval_harness_interval iterations

# A TP=2 x PP=2 run on the bundled corpus (GPT-2's vocabulary), 4 iterations, the three local tasks
# evaluated at 2 and 4
RUN = [
    "--num_layers=2",
    "--hidden_size=32",
    "--num_attention_heads=2",
    "--seq_length=32",
    "--init_method_std=0.3",
    "--micro_batch_size=2",
    "--global_batch_size=2",
    "--train_iters=4",
    "--log_interval=2",
    "--eval_interval=2",
    "--eval_iters=1",
    "--sample_tokens=0",
    "--save_interval=4",
    "--device=cpu",
    "--tensor_model_parallel_size=2",
    "--pipeline_model_parallel_size=2",
    "--eval_harness_interval=2",
    f"--eval_harness_tasks={','.join(NAMES)}",
    f"--eval_harness_include_path={TASKS}",
    "--eval_harness_only_include_path",
    "--eval_harness_batch_size=2",
]


def train(*args, nproc=1):
    env = dict(
        os.environ,
        WANDB_MODE="disabled",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    return run_python(nproc, ["train.py", *args], env)


@SLOW
def test_the_runs_evaluation_logs_what_the_tool_scores_on_its_checkpoint(offline, tmp_path, corpus):
    """Each task's numbers at iteration 4, in metrics.jsonl beside the validation loss and in
    TensorBoard, are tools/evaluate.py's on the checkpoint of iteration 4, exactly: the shards of 4
    ranks gathered in memory as a checkpoint's files are merged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import eval_harness

    proc = train(*RUN, f"--data_path={corpus}", f"--save={tmp_path}", nproc=4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["iteration"]: r for r in map(json.loads, open(tmp_path / "metrics.jsonl"))}
    tool = evaluate_tool.main(
        [
            "--load",
            str(tmp_path),
            "--tasks",
            ",".join(NAMES),
            "--include_path",
            TASKS,
            "--only_include_path",
            "--batch_size",
            "2",
        ]
    )
    expected = eval_harness.task_scalars(tool)
    # 3 tasks, 6 metrics, not all zero
    assert len(expected) == 6 and expected["stablegpt_choice/acc"] > 0
    assert {k: records[4][k] for k in expected} == expected
    assert "validation lm loss" in records[4] and set(expected) <= set(records[2])
    bits = "stablegpt_text/bits_per_byte"
    assert records[2][bits] != expected[bits]  # two iterations trained in between
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for name, value in expected.items():
        last = [(e.step, e.value) for e in events.Scalars(name)][-1]
        assert last == (4, pytest.approx(value, rel=1e-6))
    assert proc.stdout.count(" lm-eval at iteration ") == 2


def test_the_runs_evaluation_changes_nothing_of_the_training(offline, corpus):
    """lm-eval seeds Python's, NumPy's and torch's generators: with dropout on, the losses after an
    evaluation are those of the same run without one, bit for bit."""
    from helpers import losses, run_main

    run = [
        "--num_layers=1",
        "--hidden_size=32",
        "--num_attention_heads=2",
        "--seq_length=32",
        "--micro_batch_size=2",
        "--global_batch_size=2",
        "--train_iters=4",
        "--log_interval=1",
        "--eval_iters=0",
        "--sample_tokens=0",
        "--save=none",
        "--save_interval=none",
        "--hidden_dropout=0.1",
        "--attention_dropout=0.1",
        f"--data_path={corpus}",
    ]
    plain = losses(run_main(*run))
    evaluated = run_main(
        *run,
        "--eval_harness_tasks=stablegpt_choice",
        "--eval_harness_interval=2",
        f"--eval_harness_include_path={TASKS}",
        "--eval_harness_only_include_path",
        "--eval_harness_limit=2",
    )
    assert evaluated.count(" lm-eval at iteration ") == 2  # at 2 and at the last, 4
    assert losses(evaluated) == plain and len(plain) == 4


def test_an_unknown_task_stops_the_run_before_training_with_one_message(corpus, monkeypatch):
    """Refused before any process group is started, let alone a step (train.py exits 2 with the
    message, as for every ValueError)."""
    import launch
    from helpers import train_script

    monkeypatch.setattr(launch, "start", lambda cfg: pytest.fail("the run started"))
    monkeypatch.chdir(ROOT)
    with pytest.raises(
        ValueError,
        match=r"^unknown task\(s\) stablegpt_nothing: .*"
        r"eval_harness_include_path$",
    ):
        train_script()["main"](
            [
                "--num_layers=1",
                "--hidden_size=32",
                "--num_attention_heads=2",
                "--seq_length=16",
                "--train_iters=2",
                "--save=none",
                "--save_interval=none",
                f"--data_path={corpus}",
                "--eval_harness_tasks=stablegpt_choice,stablegpt_nothing",
                f"--eval_harness_include_path={TASKS}",
                "--eval_harness_only_include_path",
            ]
        )


def test_a_task_file_that_does_not_parse_is_named_with_its_parse_error(tmp_path):
    """lm-eval's index skips a YAML file it cannot read, in silence: its task is then merely unknown
    (#48)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "broken.yaml").write_text("task: broken_task\ndataset_path: json\n  bad: [unclosed\n")
    with pytest.raises(
        ValueError,
        match=r"unknown task\(s\) broken_task: .*--include_path; "
        r".*broken.yaml does not parse: \w+Error: .*line 3",
    ):
        evaluate_tool.main(
            [
                "--load",
                str(tmp_path),
                "--tasks",
                "broken_task",
                "--include_path",
                str(tasks),
                "--only_include_path",
            ]
        )


@pytest.mark.parametrize(
    "keys, message",
    [
        (
            ["--eval_harness_interval=5"],
            "eval_harness_interval=5 does nothing without eval_harness_t",
        ),
        (["--eval_harness_tasks=a", "--eval_only"], "not with eval_only: .*tools/evaluate.py"),
        (["--eval_harness_tasks= , "], "names no task"),
        (["--eval_harness_tasks=a", "--eval_harness_interval=0"], "interval .* at least 1"),
        (
            ["--eval_harness_tasks=a", "--eval_harness_only_include_path"],
            "needs eval_harness_include",
        ),
        (
            ["--eval_harness_tasks=a", "--eval_harness_include_path=/nowhere"],
            "/nowhere is not a dir",
        ),
    ],
)
def test_eval_harness_keys_that_cannot_work_are_refused(keys, message):
    import arguments

    with pytest.raises(ValueError, match=message):
        arguments.validate(arguments.load_config(keys))


def test_a_model_too_large_to_gather_is_refused_before_lm_eval_is_asked():
    import arguments
    import eval_harness
    from model import GPTConfig
    from sections import section

    sizes = ["--num_layers=24", "--hidden_size=2560", "--num_attention_heads=20"]
    cfg = arguments.load_config([*sizes, "--eval_harness_tasks=nothing"])
    with pytest.raises(ValueError, match=r"2\.0\de9 parameters.*above 2e9.*tools/evaluate.py"):
        harness_cfg = section(eval_harness.EvalHarnessConfig, cfg)
        eval_harness.RunEvaluation(harness_cfg, section(GPTConfig, cfg))
