"""lm-evaluation-harness over our GPT: an `lm_eval` model (LM) whose log-likelihoods and greedy
generations come from a checkpoint of any TP x PP x DP layout, gathered into one process as
tools/sample.py gathers it (reshard.load_full_model), tokenized with the run's own tokenizer
(tokenizer.py); and the same tasks every eval_harness_interval iterations of a run (RunEvaluation),
logged beside the validation loss.

The LM follows lm-eval's `transformers` backend (HFLM) request by request, so that a checkpoint
scores what its Hugging Face export scores under HFLM (tests/test_evaluate.py compares them per
document): the same context/continuation split (lm-eval's TemplateLM), the same left truncation to
the model's seq_length, the same rolling windows for perplexity, greedy generation cut at the same
stop strings. Requests are sorted longest first (lm-eval's Collator), right-padded and scored one
forward pass per batch: with a causal model the padding after a sequence changes none of its logits,
so no attention mask is needed.

Inside a run the model is gathered too: every (TP, PP) shard of DP rank 0 goes to the last rank,
which merges them as a checkpoint of that layout is merged (reshard.Resharder), evaluates an fp32
copy -- what tools/evaluate.py evaluates on the checkpoint of that iteration, number for number --
and logs; the other ranks wait on the host group (parallel.host_group). That costs the last rank a
whole fp32 copy of the weights: fine for small models, refused above GATHER_LIMIT parameters, where
tools/evaluate.py on the saved checkpoints (a node of its own) is the way.

Not here: the tasks (lm-eval's own, or a YAML of yours), sampling (greedy only), an evaluation
spread over the run's layout. lm-eval itself is imported only when it is used (StableGPT,
RunEvaluation): arguments.py imports this module for its keys, and a run without eval_harness_tasks
loads nothing of lm-eval.
"""

import contextlib
import numbers
import os
import random
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

import parallel
import reshard
import rng
import tokenizer
from model import GPT

# Parameters above which a run's in-loop evaluation is refused: the last rank would hold a whole
# fp32 copy (8 GB at 2e9) beside its own training state, its host every shard at once on the way.
GATHER_LIMIT = 2_000_000_000


@dataclass
class EvalHarnessConfig:
    # -- logging: lm-evaluation-harness's tasks inside the run (docs/evaluation.md) --
    eval_harness_tasks: str | None = None  # comma-separated lm-eval tasks (globs too); None: off
    eval_harness_interval: int = 1000  # run them every this many iterations (and at the end)
    eval_harness_include_path: str | None = None  # a folder of task YAML files of your own
    eval_harness_only_include_path: bool = False  # look tasks up there only (lm-eval's not indexed)
    eval_harness_num_fewshot: int | None = None  # examples in each prompt (None: the task's)
    eval_harness_limit: float | None = None  # documents per task (a fraction if < 1); None: all
    eval_harness_batch_size: int = 1  # requests per forward pass

    SWITCHED = {  # sections.py
        "eval_harness_tasks": (
            "eval_harness_interval",
            "eval_harness_include_path",
            "eval_harness_only_include_path",
            "eval_harness_num_fewshot",
            "eval_harness_limit",
            "eval_harness_batch_size",
        )
    }


def check(harness_cfg, eval_only=False):
    """Raise ValueError with the fix for eval_harness keys that cannot work (harness_cfg: an
    EvalHarnessConfig; eval_only: logging's). The task names are lm-eval's to resolve:
    RunEvaluation, before training starts."""
    if harness_cfg.eval_harness_tasks is None:  # its other keys: arguments.validate (SWITCHED)
        return
    if not task_names(harness_cfg.eval_harness_tasks):
        raise ValueError(
            f"eval_harness_tasks={harness_cfg.eval_harness_tasks!r} names no task; "
            "give comma-separated lm-eval task names, or None to evaluate none"
        )
    if eval_only:
        raise ValueError(
            "eval_harness_tasks runs during training, not with eval_only: evaluate "
            "the checkpoint with tools/evaluate.py --load DIR --tasks ..."
        )
    if harness_cfg.eval_harness_interval < 1 or harness_cfg.eval_harness_batch_size < 1:
        raise ValueError("eval_harness_interval and eval_harness_batch_size must be at least 1")
    limit = harness_cfg.eval_harness_limit
    if (harness_cfg.eval_harness_num_fewshot or 0) < 0 or (limit is not None and limit <= 0):
        raise ValueError(
            "eval_harness_num_fewshot must not be negative and eval_harness_limit must be positive"
        )
    if harness_cfg.eval_harness_only_include_path and not harness_cfg.eval_harness_include_path:
        raise ValueError(
            "eval_harness_only_include_path needs eval_harness_include_path (the "
            "folder of your tasks)"
        )
    include_path = harness_cfg.eval_harness_include_path
    if include_path and not os.path.isdir(include_path):
        raise ValueError(f"eval_harness_include_path {include_path} is not a directory")


def task_names(text):
    return [t.strip() for t in text.split(",") if t.strip()]


# -----------------------------------------------------------------------------
# Tasks: lm-eval's index, the names checked, the evaluation (tools/evaluate.py's and the run's)


def task_manager(include_path=None, only_include_path=False):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=not only_include_path)


def known_tasks(names, manager, include_path=None, flag="--include_path"):
    """The tasks, groups or tags names stand for (a glob: every one it matches, in order), each one
    lm-eval knows, or one ValueError naming those it does not, with the parse error of each YAML
    file under include_path that does not parse (lm-eval's index skips such a file in silence: its
    task is then merely "unknown")."""
    matches = {n: manager.match_tasks([n]) for n in names}
    unknown = [n for n, found in matches.items() if not found]
    if unknown:
        broken = "".join(
            f"; {path} does not parse: {error}" for path, error in unparsable(include_path)
        )
        raise ValueError(
            f"unknown task(s) {', '.join(unknown)}: `lm-eval list tasks` lists "
            "lm-eval's; a task of your own is a YAML file in the folder given to "
            f"{flag}{broken}"
        )
    return list(dict.fromkeys(t for found in matches.values() for t in found))


def unparsable(folder):
    """[(path, the error)] of each .yaml/.yml file under folder that lm-eval's YAML loader
    refuses."""
    if not folder:
        return []
    try:  # what lm-eval's index (0.4.13) reads each file with; private: another version may move it
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:
        return []
    found = []
    for directory, _, files in sorted(os.walk(folder)):
        for name in sorted(f for f in files if f.endswith((".yaml", ".yml"))):
            path = os.path.join(directory, name)
            try:
                load_yaml(path, resolve_func=False)
            except Exception as e:  # a YAML syntax error, an include that is missing, ...
                found.append((path, " ".join(f"{type(e).__name__}: {e}".split())))
    return found


def evaluate(lm, tasks, manager, num_fewshot=None, limit=None, log_samples=False, seed=1234):
    """lm_eval.simple_evaluate's results of the LM lm on tasks (names manager knows); its batch size
    and device recorded in the results' config."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=lm.batch_size,
        device=str(lm.device),
        task_manager=manager,
        log_samples=log_samples,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )


def task_scalars(results):
    """{"TASK/METRIC": value} of lm-eval's results, each task's (or group's) metrics; a filter other
    than lm-eval's "none" after it (TASK/METRIC/FILTER). Standard errors are left out (they may read
    "N/A")."""
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, kept = key.partition(",")
            real = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if kept and real and not metric.endswith("_stderr"):
                out[f"{task}/{metric}" + ("" if kept == "none" else f"/{kept}")] = float(value)
    return out


# -----------------------------------------------------------------------------
# Inside a run


class RunEvaluation:
    """eval_harness_tasks every eval_harness_interval iterations (and at the last), on the last
    rank, logged through the run's report.Report under each task's name. Made before training starts
    (train.main): the task names, the model's size and the tokenizer are checked there, on every
    rank, with one message."""

    def __init__(self, harness_cfg, model_cfg, tokenizer_file=None):
        """harness_cfg: an EvalHarnessConfig; model_cfg: the run's model.GPTConfig; tokenizer_file:
        the data's."""
        self.harness_cfg, self.model_cfg = harness_cfg, model_cfg
        n = model_cfg.num_parameters()
        if n > GATHER_LIMIT:
            raise ValueError(
                f"eval_harness_tasks: this model ({n / 1e9:.2f}e9 parameters) would "
                "be gathered whole, in fp32, onto one rank (eval_harness.py); above "
                f"{GATHER_LIMIT / 1e9:.0f}e9 that is refused: evaluate its "
                "checkpoints with tools/evaluate.py instead"
            )
        self.tok = tokenizer.get_tokenizer(tokenizer_file)
        if self.tok.n_vocab > model_cfg.vocab_size:
            raise ValueError(
                f"eval_harness_tasks: the tokenizer has {self.tok.n_vocab} ids but "
                f"vocab_size is {model_cfg.vocab_size}: lm-eval's texts would hold "
                "ids the model has no row for"
            )
        self.manager = task_manager(
            harness_cfg.eval_harness_include_path, harness_cfg.eval_harness_only_include_path
        )
        self.tasks = known_tasks(
            task_names(harness_cfg.eval_harness_tasks),
            self.manager,
            harness_cfg.eval_harness_include_path,
            flag="eval_harness_include_path",
        )

    def due(self, iteration, last):
        return last or iteration % self.harness_cfg.eval_harness_interval == 0

    def __call__(self, model, iteration, state, report, device):
        """Evaluate the run's weights at iteration (every rank calls it), log each task's
        numbers."""
        with untouched_random_streams(device):  # building the whole model draws too
            gpt = gathered(model, self.model_cfg, iteration)
            if gpt is not None:  # the last rank
                keys = self.harness_cfg
                lm = lm_class()(gpt.to(device), self.tok, batch_size=keys.eval_harness_batch_size)
                with alone():
                    results = evaluate(
                        lm,
                        self.tasks,
                        self.manager,
                        keys.eval_harness_num_fewshot,
                        keys.eval_harness_limit,
                    )
        if gpt is not None:
            values = task_scalars(results)
            print(
                f" lm-eval at iteration {iteration} | "
                + " | ".join(f"{k}: {v:.6E}" for k, v in values.items())
                + " |",
                flush=True,
            )
            report.scalars(values, iteration, state)
            report.record(iteration, values)
        if parallel.grid.world_size > 1:  # the others wait as long as a host's work may take
            dist.barrier(group=parallel.host_group())


def gathered(model, model_cfg, iteration):
    """The run's whole model at iteration, fp32, on the CPU, in eval mode, on the last rank (None on
    the others): DP rank 0's shard of every (TP, PP) rank sent there over the host group and merged
    by reshard.Resharder as the checkpoint of this iteration would be. Every rank calls it."""
    grid = parallel.grid
    gpt = parallel.unwrap(model)
    mine = None
    if grid.dp_rank == 0:
        state = {k: v.detach().cpu() for k, v in gpt.state_dict().items()}
        mine = (grid.tp_rank, grid.pp_rank, state)
    last = grid.world_size - 1
    shards = [mine]
    if grid.world_size > 1:
        shards = [None] * grid.world_size if grid.rank == last else None
        dist.gather_object(mine, shards, dst=last, group=parallel.host_group())
    if grid.rank != last:
        return None
    # the vocabulary padded for one process, as the tools load
    whole = replace(model_cfg, tensor_model_parallel_size=1)
    with torch.device("cpu"):
        full = GPT(whole, grid=parallel.Grid(1, 1, world_size=1, rank=0)).eval()
    shards = [s for s in shards if s is not None]
    layout = GatheredLayout(shards, model_cfg, grid.pp_size, iteration)
    full.load_state_dict(reshard.Resharder(layout, full).model_state())
    return full.float()


class GatheredLayout:
    """The run's shards, read as reshard.Resharder reads the model files of a checkpoint
    (reshard.SavedLayout)."""

    def __init__(self, shards, model_cfg, pp_size, iteration):
        self.tag_dir = f"(the run's weights at iteration {iteration})"  # for Resharder's messages
        self.tp, self.pp = model_cfg.tensor_model_parallel_size, pp_size
        self.config = {"vocab_size": model_cfg.vocab_size}
        self.models = {(tp, pp): {"model": state} for tp, pp, state in shards}
        self.stage_of = {}  # each name's stage; the first stage's wins for the tied embedding
        for pp in reversed(range(self.pp)):
            for name in self.models[0, pp]["model"]:
                self.stage_of[reshard.TIED_COPY.get(name, name) if pp else name] = pp

    def model(self, tp, pp):
        return self.models[tp, pp]


@contextlib.contextmanager
def untouched_random_streams(device):
    """lm-eval seeds Python's, NumPy's and torch's generators, and building a model draws from
    torch's: the training run's streams (dropout; rng.py's model-parallel one too) are put back
    after the block, so that a run draws what it would have drawn without the evaluation."""
    py, npy, model_parallel = random.getstate(), np.random.get_state(), rng.get_states()
    cuda = [device] if torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        rng.set_states(model_parallel)  # Megatron's model-parallel stream (rng.py)


@contextlib.contextmanager
def alone():
    """This rank as one process while the gathered model runs: parallel.grid one process's, so that
    its forward talks to no other rank (a TP>1 grid would all-reduce with ranks that wait at the
    barrier); LOCAL_RANK 0, without which lm_eval.simple_evaluate returns no results (it takes a
    LOCAL_RANK > 0 for a TP worker)."""
    run_grid, parallel.grid = parallel.grid, parallel.Grid(1, 1, world_size=1, rank=0)
    local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        parallel.grid = run_grid
        if local_rank is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = local_rank


# -----------------------------------------------------------------------------
# The lm-eval model


def lm_class():
    """StableGPT: LMAdapter as an lm-eval TemplateLM, made at its first use (importing lm-eval takes
    seconds)."""
    if "StableGPT" not in globals():
        from lm_eval.api.model import TemplateLM

        globals()["StableGPT"] = type(
            "StableGPT",
            (LMAdapter, TemplateLM),
            {"__doc__": LMAdapter.__doc__, "__module__": __name__},
        )
    return globals()["StableGPT"]


def __getattr__(name):  # eval_harness.StableGPT (tools/evaluate.py, tests): made on first use
    if name == "StableGPT":
        return lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class LMAdapter:
    """lm-eval's LM (as StableGPT, with TemplateLM) over a whole GPT (TP=1, PP=1) in eval mode.
    model: a GPT; tok: its run's tokenizer (tokenizer.get_tokenizer); batch_size: requests per
    forward pass; max_gen_toks: generate_until's default where a task sets none (HFLM's 256)."""

    def __init__(self, model, tok, batch_size=1, max_gen_toks=256, info=None):
        super().__init__()
        tokenizer.check_vocab(tok, model.config.vocab_size)
        if batch_size < 1 or max_gen_toks < 1:
            raise ValueError("batch_size and max_gen_toks must be at least 1")
        self.model, self.tok = model.eval(), tok
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self.max_length = model.config.seq_length  # the longest window the model was trained on
        # the logits of the padding ids are never scored or generated
        self.vocab_size = model.config.vocab_size
        self._device = next(model.parameters()).device  # lm-eval's LM.device reads it
        self.info = info or {}

    @classmethod
    def from_checkpoint(cls, load_dir, device="cpu", dtype=None, tokenizer_file=None, **kwargs):
        """The LM of load_dir's latest checkpoint (any layout), on device, in dtype (default: as saved),
        with tokenizer_file's tokenizer (default: the run's)."""
        # the tokenizer first: a tokenizer_file not on this machine, or not the model's, is refused
        # before the gather
        cfg, saved, _ = reshard.saved_model_config(load_dir)
        tok = tokenizer.run_tokenizer(saved.get("tokenizer_file"), tokenizer_file)
        tokenizer.check_vocab(tok, cfg.vocab_size)
        model, _, tag_dir = reshard.load_full_model(load_dir)
        model = model.to(device=device, dtype=dtype)
        info = {"checkpoint": tag_dir, "dtype": str(next(model.parameters()).dtype)}
        return cls(model, tok, info=info, **kwargs)

    def get_model_info(self):
        return dict(self.info)  # lm-eval adds it to its results' config

    # -- tokens -----------------------------------------------------------------------------------------------

    @property
    def eot_token_id(self):
        # also the prefix of an empty context and of a document's first window
        return self.tok.eot_token

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        # A special token's literal text is that token, as in transformers' tokenizers (HFLM); tiktoken's
        # encode_ordinary would spell it out. A tokenizer.json (TokenizerFile) already reads it so.
        if hasattr(self.tok, "special_tokens_set"):  # tiktoken's Encoding
            return self.tok.encode(string, allowed_special="all")
        return self.tok.encode_ordinary(string)

    # -- log-likelihoods --------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """[(log p(continuation | context), is it the greedy continuation)] of requests
        [((context, continuation) strings, context ids, continuation ids)], scored a batch at a time."""
        from lm_eval.models.utils import Collator

        order = Collator(requests, sort_fn=lambda r: (-len(r[1]) - len(r[2]), tuple(r[1] + r[2])))
        results = []
        for chunk in order.get_batched(n=self.batch_size):
            results += self.score([r[1] + r[2] for r in chunk], [len(r[2]) for r in chunk])
        return order.get_original(results)

    @torch.no_grad()
    def score(self, sequences, continuation_lengths):
        """[(sum of the log-probabilities of the last n tokens of each sequence, are they all the argmax)]: one
        forward pass over the batch. A sequence over seq_length + 1 tokens loses its first tokens (as in HFLM)."""
        if max(continuation_lengths) > self.max_length:
            raise ValueError(
                f"a continuation of {max(continuation_lengths)} tokens is longer than the model's "
                f"seq_length {self.max_length}"
            )
        sequences = [s[-(self.max_length + 1) :] for s in sequences]
        ids, lengths = self.right_padded([s[:-1] for s in sequences])
        targets, _ = self.right_padded([s[1:] for s in sequences])
        ids, lengths, targets = (t.to(self.device) for t in (ids, lengths, targets))
        logits = self.logits(ids)  # (B, T, vocab) in fp32
        # log p of each target
        picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        # the continuation: the last n positions before each sequence's padding
        position = torch.arange(ids.shape[1], device=self.device)
        n = torch.tensor(continuation_lengths, device=self.device)
        scored = (position < lengths[:, None]) & (position >= (lengths - n)[:, None])
        total = torch.where(scored, picked, 0.0).sum(-1)
        greedy = ((logits.argmax(-1) == targets) | ~scored).all(-1)
        return list(zip(total.tolist(), greedy.tolist()))

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Each document's log-likelihood, scored in disjoint windows of seq_length tokens (the first after the
        end-of-document id), as HFLM does; the windows of all documents are batched together."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            for context, target in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, target))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    # -- generation -------------------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm=False):
        """Greedy continuations of each context, cut before the first of its stop strings (`until`, and the
        end-of-document token's text) and after max_gen_toks tokens; batched among requests of the same kwargs."""
        from lm_eval.models.utils import Collator

        order = Collator(
            [r.args for r in requests],
            sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
            group_by="gen_kwargs",
            group_fn=lambda a: a[1],
        )
        results = []
        for chunk in order.get_batched(n=self.batch_size):
            contexts, kwargs = zip(*chunk)
            results += self.generate_batch(list(contexts), kwargs[0])
        return order.get_original(results)

    def generate_batch(self, contexts, gen_kwargs):
        """The texts generate_until answers for contexts that share gen_kwargs (one batch)."""
        from lm_eval.models.utils import (
            handle_stop_sequences,
            normalize_gen_kwargs,
            postprocess_generated_text,
        )

        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        if kwargs.get("do_sample"):
            raise ValueError(
                f"only greedy generation is implemented; the task asks to sample ({gen_kwargs}): "
                "set do_sample: false (or temperature: 0) in its generation_kwargs"
            )
        until = handle_stop_sequences(kwargs["until"], eos=self.tok.decode([self.eot_token_id]))
        max_new = kwargs["max_gen_toks"]
        if max_new >= self.max_length:
            raise ValueError(
                f"max_gen_toks {max_new} leaves no room for a context in seq_length {self.max_length}"
            )
        # as HFLM: the context keeps its last seq_length - max_gen_toks tokens
        # an empty context starts after the end-of-document id, as a document does (and as tools/sample.py)
        prompts = [
            self.tok_encode(c)[-(self.max_length - max_new) :] or [self.eot_token_id]
            for c in contexts
        ]
        return [
            postprocess_generated_text(self.tok.decode(new), until, None)
            for new in self.greedy(prompts, max_new, until)
        ]

    @torch.no_grad()
    def greedy(self, prompts, max_new, until):
        """The greedy continuation of each prompt (token ids), up to max_new tokens and stopped at the end of
        document or once its text holds a stop string. Right-padded: each row's next token is read at its own
        end and written after it, one forward pass of the batch per generated token (no cache, as
        GPT.generate)."""
        ids, lengths = self.right_padded(prompts, room=max_new)
        longest = int(lengths.max())
        ids, lengths = ids.to(self.device), lengths.to(self.device)
        rows = torch.arange(len(prompts), device=self.device)
        new, done = [[] for _ in prompts], [False] * len(prompts)
        for step in range(max_new):
            token = self.logits(ids[:, : longest + step])[rows, lengths - 1].argmax(-1)
            ids[rows, lengths] = token
            lengths += 1
            # one host sync per step: the stop rule reads text
            for i, t in enumerate(token.tolist()):
                if done[i] or t == self.eot_token_id:
                    done[i] = True
                    continue
                new[i].append(t)
                done[i] = any(s in self.tok.decode(new[i]) for s in until)
            if all(done):
                break
        return new

    def logits(self, ids):
        """(B, T, vocab_size) fp32 logits of ids (B, T), the vocabulary's padding dropped."""
        return self.model(ids)[..., : self.vocab_size].float()

    @staticmethod
    def right_padded(sequences, room=0):
        """(ids (B, longest + room) padded on the right with 0, lengths (B,)), on the CPU."""
        lengths = torch.tensor([len(s) for s in sequences])
        ids = torch.zeros(len(sequences), int(lengths.max()) + room, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(s)
        return ids, lengths
