"""lm-evaluation-harness over our GPT: an `lm_eval` model (LM) whose log-likelihoods and greedy generations come
from a checkpoint of any TP x PP x DP layout, gathered into one process as tools/sample.py gathers it
(reshard.load_full_model), tokenized with the run's own tokenizer (tokenizer.py).

It follows lm-eval's `transformers` backend (HFLM) request by request, so that a checkpoint scores what its
Hugging Face export scores under HFLM (tests/test_evaluate.py compares them per document): the same
context/continuation split (lm-eval's TemplateLM), the same left truncation to the model's seq_length, the same
rolling windows for perplexity, greedy generation cut at the same stop strings. Requests are sorted longest
first (lm-eval's Collator), right-padded and scored one forward pass per batch: with a causal model the padding
after a sequence changes none of its logits, so no attention mask is needed.

Not here: the tasks (lm-eval's own, or a YAML of yours; tools/evaluate.py runs them), sampling (greedy only),
several processes (the model is gathered into one), evaluation inside a training run. Nothing of ours imports
this module but tools/: it pulls in lm-eval and its dependencies.
"""
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import reshard
import tokenizer


class StableGPT(TemplateLM):
    """lm-eval's LM over a whole GPT (TP=1, PP=1) in eval mode. model: a GPT; tok: its run's tokenizer
    (tokenizer.get_tokenizer); batch_size: requests per forward pass; max_gen_toks: generate_until's default
    where a task sets none (HFLM's 256)."""

    def __init__(self, model, tok, batch_size=1, max_gen_toks=256, info=None):
        super().__init__()
        if tok.n_vocab > model.cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tok.n_vocab} ids but the model only {model.cfg.vocab_size}: "
                             "evaluate with the tokenizer the model was trained with (its tokenizer_file)")
        if batch_size < 1 or max_gen_toks < 1:
            raise ValueError("batch_size and max_gen_toks must be at least 1")
        self.model, self.tok = model.eval(), tok
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self.max_length = model.cfg.seq_length  # the longest window the model was trained on
        self.vocab_size = model.cfg.vocab_size  # the logits of the padding ids are never scored or generated
        self._device = next(model.parameters()).device  # lm-eval's LM.device reads it
        self.info = info or {}

    @classmethod
    def from_checkpoint(cls, load_dir, device="cpu", dtype=None, **kwargs):
        """The LM of load_dir's latest checkpoint (any layout), on device, in dtype (default: as saved)."""
        model, saved, tag_dir = reshard.load_full_model(load_dir)
        model = model.to(device=device, dtype=dtype)
        info = {"checkpoint": tag_dir, "dtype": str(next(model.parameters()).dtype)}
        return cls(model, tokenizer.get_tokenizer(saved.get("tokenizer_file")), info=info, **kwargs)

    def get_model_info(self):
        return dict(self.info)  # lm-eval adds it to its results' config

    # -- tokens -----------------------------------------------------------------------------------------------

    @property
    def eot_token_id(self):
        return self.tok.eot_token  # also the prefix of an empty context and of a document's first window

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
            raise ValueError(f"a continuation of {max(continuation_lengths)} tokens is longer than the model's "
                             f"seq_length {self.max_length}")
        sequences = [s[-(self.max_length + 1):] for s in sequences]
        ids, lengths = self.right_padded([s[:-1] for s in sequences])
        targets, _ = self.right_padded([s[1:] for s in sequences])
        ids, lengths, targets = (t.to(self.device) for t in (ids, lengths, targets))
        logits = self.logits(ids)  # (B, T, vocab) in fp32
        picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)  # log p of each target
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
        windows, owner = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            for context, target in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
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
        order = Collator([r.args for r in requests], sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
                         group_by="gen_kwargs", group_fn=lambda a: a[1])
        results = []
        for chunk in order.get_batched(n=self.batch_size):
            contexts, kwargs = zip(*chunk)
            results += self.generate_batch(list(contexts), kwargs[0])
        return order.get_original(results)

    def generate_batch(self, contexts, gen_kwargs):
        """The texts generate_until answers for contexts that share gen_kwargs (one batch)."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        if kwargs.get("do_sample"):
            raise ValueError(f"only greedy generation is implemented; the task asks to sample ({gen_kwargs}): "
                             "set do_sample: false (or temperature: 0) in its generation_kwargs")
        until = handle_stop_sequences(kwargs["until"], eos=self.tok.decode([self.eot_token_id]))
        max_new = kwargs["max_gen_toks"]
        if max_new >= self.max_length:
            raise ValueError(f"max_gen_toks {max_new} leaves no room for a context in seq_length {self.max_length}")
        # as HFLM: the context keeps its last seq_length - max_gen_toks tokens
        # an empty context starts after the end-of-document id, as a document does (and as tools/sample.py)
        prompts = [self.tok_encode(c)[-(self.max_length - max_new):] or [self.eot_token_id] for c in contexts]
        return [postprocess_generated_text(self.tok.decode(new), until, None)
                for new in self.greedy(prompts, max_new, until)]

    @torch.no_grad()
    def greedy(self, prompts, max_new, until):
        """The greedy continuation of each prompt (token ids), up to max_new tokens and stopped at the end of
        document or once its text holds a stop string. Right-padded: each row's next token is read at its own
        end and written after it, one forward pass of the batch per generated token (no cache, as
        model.generate)."""
        ids, lengths = self.right_padded(prompts, room=max_new)
        longest = int(lengths.max())
        ids, lengths = ids.to(self.device), lengths.to(self.device)
        rows = torch.arange(len(prompts), device=self.device)
        new, done = [[] for _ in prompts], [False] * len(prompts)
        for step in range(max_new):
            token = self.logits(ids[:, :longest + step])[rows, lengths - 1].argmax(-1)
            ids[rows, lengths] = token
            lengths += 1
            for i, t in enumerate(token.tolist()):  # one host sync per step: the stop rule reads text
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
        return self.model(ids)[..., :self.vocab_size].float()

    @staticmethod
    def right_padded(sequences, room=0):
        """(ids (B, longest + room) padded on the right with 0, lengths (B,)), on the CPU."""
        lengths = torch.tensor([len(s) for s in sequences])
        ids = torch.zeros(len(sequences), int(lengths.max()) + room, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, :len(s)] = torch.tensor(s)
        return ids, lengths
