"""Stability telemetry: what a run records so that a spike can be seen coming and analysed
after the fact (lesson 21).

Every `telemetry_interval` iterations, per layer (embedding, blocks 1..L, final LayerNorm):
  grad norm, grad RMS (to hold against Adam's eps: updates shrink once it nears eps, Wortsman et al. 2023),
  parameter norm, update/parameter RMS ratio (|p_after - p_before| / |p_after|, the update measured on the fp32
  master weights the optimizer steps),
  RMS of the block's output, the largest pre-softmax attention logit, the lowest attention entropy of a head
  (its mean over queries; collapsing entropy precedes attention-logit instabilities, Zhai et al. 2023; both of
  q k^T alone, without ALiBi's bias),
and for the model: the mean and largest log-sum-exp of the output logits (log Z, the quantity z-loss keeps near
0, lesson 20), the mean output logit (it drifts with log Z when nothing holds it, Wortsman et al.'s fig. 4), the
RMS entering the final LayerNorm and the word-embedding norm (what the embedding LayerNorm of lesson 1 holds in
check).

Norms are taken with foreach ops over the parameters that make up the model exactly once (parallel's
counted_once rule), summed into per-layer slots on the device, and every statistic takes part in one SUM and
one MAX all-reduce over all ranks; a single host transfer at the end. The forward probes (block-output hooks, the
attention and logits probes of model.py) are installed only on telemetry iterations, so other iterations pay
nothing. Fused attention never forms q k^T, so on telemetry iterations the probe computes it once more.

The statistics go to TensorBoard, wandb and metrics.jsonl through report.py (scalars() names them).
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

import parallel
import training
from report import print0


class Telemetry:
    def __init__(self, model, model_cfg, optimizer=None):
        """model_cfg: the model's shape (a model.GPTConfig). optimizer: the one that steps the model
        (optim.optimizer_for's), whose fp32 master weights the update/param ratio is measured on;
        None: the model's weights themselves."""
        self.gpt = parallel.unwrap(model)
        self.main_param = getattr(optimizer, "main_param", lambda p: p)
        # ZeRO-1: each master is on one DP rank only, so the sum over DP ranks counts it once (not dp_size times)
        self.masters_sharded = isinstance(optimizer, parallel.ZeroShardedOptimizer)
        self.num_layers, self.vocab_size = model_cfg.num_layers, model_cfg.vocab_size
        self.n = model_cfg.num_layers + 2  # slot 0: embedding, 1..L: blocks, L+1: final LayerNorm
        self.heads = model_cfg.num_attention_heads
        counted = {id(p) for p in parallel.counted_once(model)}
        self.params, slots = [], []
        for name, p in self.gpt.named_parameters():
            if id(p) in counted:
                self.params.append(p)
                slots.append(self._slot(name))
        self.device = self.params[0].device
        self.index = torch.tensor(slots, device=self.device)
        self.numel = self._zeros(
            self.n
        ).index_add_(  # each layer's parameter count (this rank's share)
            0, self.index, torch.tensor([float(p.numel()) for p in self.params], device=self.device)
        )
        self.handles = []

    def _slot(self, name):
        if name.startswith("embed."):
            return 0
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        return self.n - 1

    def _zeros(self, n, fill=0.0):
        return torch.full((n,), fill, dtype=torch.float32, device=self.device)

    def _per_slot(self, tensors, index):
        """Squared norms of the tensors summed into their layers' slots (index: each tensor's slot)."""
        sums = self._zeros(self.n)
        if tensors:
            norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
            sums.index_add_(0, index, norms.square())
        return sums

    # -- one telemetry iteration: begin (before forward), grads/updated (inside train_step), finish ------------

    def begin(self):
        L = self.num_layers
        self.act = self._zeros(2 * L)  # sum of mean squares, number of calls
        self.attn = self._zeros(L, -math.inf)
        # per (layer, head): sum over queries, number of queries
        self.entropy = self._zeros(2 * L * self.heads)
        self.logz = self._zeros(3)  # sum over tokens, token count, max
        self.logz[2] = -math.inf
        self.logit = self._zeros(2)  # sum of the output logits (the real vocabulary's), their count
        # sum of mean squares entering the final LayerNorm, number of calls
        self.final_input = self._zeros(2)
        self.grad_sq = self.param_sq = self.update_sq = self._zeros(self.n)
        self.before = None
        for key, block in self.gpt.blocks.items():
            layer = int(key)
            if parallel.grid.tp_rank == 0:  # a block's output is replicated over TP: counted once
                self.handles.append(
                    block.register_forward_hook(
                        lambda module, args, out, layer=layer: self._block_output(layer, out)
                    )
                )
            block.attn.probe = lambda q, k, layer=layer: self._attention(layer, q, k)
        if self.gpt.post_process:
            self.gpt.logits_probe = self._logits
            if parallel.grid.tp_rank == 0:  # replicated over TP, as a block's output
                self.handles.append(
                    self.gpt.ln_f.register_forward_pre_hook(
                        lambda module, args: self._final_input(args[0])
                    )
                )

    @torch.no_grad()
    def _block_output(self, layer, out):
        # with activation checkpointing the recomputation calls this again with the same output: the mean over
        # calls is unchanged
        self.act[layer] += out.detach().float().square().mean()
        self.act[self.num_layers + layer] += 1

    @torch.no_grad()
    def _final_input(self, x):
        self.final_input[0] += x.detach().float().square().mean()
        self.final_input[1] += 1

    @torch.no_grad()
    def _attention(self, layer, q, k):
        local_heads, T, D = q.shape[-3], q.shape[-2], q.shape[-1]
        q, k = q.reshape(-1, T, D), k.reshape(-1, T, D)  # rows: batch-major, then this rank's heads
        # this rank's heads are contiguous
        first_head = layer * self.heads + parallel.grid.tp_rank * local_heads
        # the causal mask added by baddbmm's beta term: one fused op, no masked copy of the scores
        mask = torch.full((1, T, T), -math.inf, device=q.device).triu(1)
        # bounds the fp32 scores in flight to 64 MB (and their softmax)
        rows = max(1, 2**24 // (T * T))
        for i in range(0, q.shape[0], rows):
            scores = torch.baddbmm(
                mask,
                q[i : i + rows].float(),
                k[i : i + rows].float().transpose(1, 2),
                alpha=1.0 / math.sqrt(D),
            )
            self.attn[layer] = torch.maximum(self.attn[layer], scores.amax())
            probs = scores.softmax(-1)
            entropy = -torch.special.xlogy(probs, probs).sum(-1).sum(-1)  # masked keys: 0 log 0 = 0
            head = first_head + torch.arange(i, i + len(scores), device=q.device) % local_heads
            self.entropy.index_add_(0, head, entropy)
            self.entropy.index_add_(
                0, head + self.num_layers * self.heads, torch.full_like(entropy, T)
            )

    @torch.no_grad()
    def _logits(self, lse, hidden, weight):
        # log Z per token of the output softmax (padding left out), combined over TP by the loss itself
        g = parallel.grid
        if g.tp_rank == 0:
            self.logz[0] += lse.sum()
            self.logz[1] += lse.numel()
            self.logz[2] = torch.maximum(self.logz[2], lse.max())
        # the sum of this rank's real logits without the logits: sum_v h . w_v = h . (sum_v w_v)
        real = min(max(self.vocab_size - g.tp_rank * weight.shape[0], 0), weight.shape[0])
        self.logit[0] += (hidden.detach().float() @ weight.detach()[:real].float().sum(0)).sum()
        self.logit[1] += lse.numel() * real

    @torch.no_grad()
    def grads(self, loss_scale=1.0):
        """After the gradients are reduced, before clipping and the update; they are still multiplied by
        loss_scale (fp16)."""
        grads = [parallel.main_grad(p) for p in self.params]
        with_grad = [i for i, g in enumerate(grads) if g is not None]
        self.updating, self.updating_index = (
            [self.params[i] for i in with_grad],
            self.index[with_grad],
        )
        self.grad_sq = (
            self._per_slot([grads[i] for i in with_grad], self.updating_index) / loss_scale**2
        )
        # The update is measured on the fp32 masters the optimizer steps: on bf16/fp16 weights most updates are
        # below half an ulp and round away (ZeRO-1: only the masters this rank holds).
        masters = [self.main_param(p) for p in self.updating]
        held = [i for i, m in enumerate(masters) if m is not None]
        self.masters, self.masters_index = [masters[i] for i in held], self.updating_index[held]
        self.before = torch._foreach_mul(self.masters, 1.0)  # a copy, on telemetry iterations only

    @torch.no_grad()
    def updated(self):
        """After the optimizer step (not called when the step was skipped: the update is then zero)."""
        # in place: before - after, the update's negative
        torch._foreach_sub_(self.before, self.masters)
        self.update_sq = self._per_slot(self.before, self.masters_index)
        if self.masters_sharded:
            self.update_sq *= parallel.grid.dp_size  # finish() divides the DP sum by dp_size

    @torch.no_grad()
    def finish(self):
        """Remove the probes, reduce over all ranks, return the statistics as plain numbers."""
        self._remove_probes()
        self.param_sq = self._per_slot(self.params, self.index)
        sums, maxes = self._reduced()
        return self._statistics(sums, maxes)

    def _remove_probes(self):
        """Take the forward probes out of the model and drop the copy of the masters."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for block in self.gpt.blocks.values():
            block.attn.probe = None
        self.gpt.logits_probe = None
        self.before = None

    def _reduced(self):
        """(sums, maxes): every statistic summed, or maxed, over all ranks, as plain numbers."""
        word = self.gpt.embed.word.weight if self.gpt.embed is not None else None
        embed_sq = (
            word.detach().float().square().sum().view(1) if word is not None else self._zeros(1)
        )
        g = parallel.grid
        # Parameter statistics are the same on every DP rank; activations differ.
        # One SUM and one MAX reduction.
        n = self.n
        sums = torch.cat(
            [
                self.grad_sq,
                self.param_sq,
                self.update_sq,
                self.numel,
                embed_sq,
                self.act,
                self.logz[:2],
                self.logit,
                self.final_input,
                self.entropy,
            ]
        )
        maxes = torch.cat([self.attn, self.logz[2:]])
        if dist.is_initialized() and g.world_size > 1:
            dist.all_reduce(sums)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            sums[: 4 * n + 1] /= g.dp_size
        return sums.tolist(), maxes.tolist()

    def _statistics(self, sums, maxes):
        """The reduced numbers (_reduced's layout) as named statistics: per-layer lists and scalars."""
        n, L, LH = self.n, self.num_layers, self.num_layers * self.heads
        grad, param, update, numel = (
            sums[:n],
            sums[n : 2 * n],
            sums[2 * n : 3 * n],
            sums[3 * n : 4 * n],
        )
        act = sums[4 * n + 1 : 4 * n + 1 + 2 * L]
        logz_sum, logz_count, logit_sum, logit_count, final_sum, final_calls = sums[
            4 * n + 1 + 2 * L : -2 * LH
        ]
        entropy = [s / c if c else float("nan") for s, c in zip(sums[-2 * LH : -LH], sums[-LH:])]
        return {
            "grad norm": [math.sqrt(v) for v in grad],
            "grad rms": [math.sqrt(v / c) if c else float("nan") for v, c in zip(grad, numel)],
            "param norm": [math.sqrt(v) for v in param],
            "update/param rms": [math.sqrt(u / p) if p > 0 else 0.0 for u, p in zip(update, param)],
            "block output rms": [
                math.sqrt(s / c) if c else float("nan") for s, c in zip(act[:L], act[L:])
            ],
            "attention logit max": maxes[:L],
            "attention entropy min": [
                min(entropy[layer * self.heads : (layer + 1) * self.heads]) for layer in range(L)
            ],
            "log z": logz_sum / logz_count if logz_count else float("nan"),
            "log z max": maxes[L],
            "output logit mean": logit_sum / logit_count if logit_count else float("nan"),
            "final layernorm input rms": math.sqrt(final_sum / final_calls)
            if final_calls
            else float("nan"),
            "word embedding norm": math.sqrt(sums[4 * n]),
        }


def scalars(stats):
    """Telemetry flattened to TensorBoard / wandb scalar names: telemetry/grad-norm/layer-03 ..."""
    out = {}
    for key, value in stats.items():
        name = "telemetry/" + key.replace(" ", "-").replace("/", "-")
        if isinstance(value, list):
            labels = layer_labels(len(value), len(stats["block output rms"]))
            out.update({f"{name}/{label}": v for label, v in zip(labels, value)})
        else:
            out[name] = value
    return out


def layer_labels(count, num_layers):
    """Row labels of a per-layer statistic: 'embedding', 'layer-01' .. 'layer-L', 'final' (or the blocks only)."""
    blocks = [f"layer-{i:02d}" for i in range(1, num_layers + 1)]
    return ["embedding", *blocks, "final"] if count == num_layers + 2 else blocks


class Probe(training.Callback):
    """The hooks of one step a Telemetry records (bench.py's timed steps; Recording does the same on the telemetry
    iterations of a run): the gradients read before the update, the update after it."""

    def __init__(self, recorder):
        self.recorder = recorder

    def on_grads(self, model, loss_scale):
        self.recorder.grads(loss_scale)

    def after_update(self):
        self.recorder.updated()


@dataclass
class TelemetryConfig:  # Recording
    # -- stability: telemetry --
    # per-layer grad/param/update norms, activations, logits every N iterations (0: off)
    telemetry_interval: int = 0


class Recording(training.Callback):
    """A run's telemetry: a record every telemetry_interval iterations, to TensorBoard, wandb and metrics.jsonl
    (report.py); `record` holds this iteration's (None on the others), for the precursor rung."""

    Config = TelemetryConfig  # its section: stability.build_callbacks builds it with it

    name = "telemetry"

    def __init__(self, telemetry_cfg, shared, model_cfg):
        self.model_cfg, self.interval = model_cfg, telemetry_cfg.telemetry_interval  # for Telemetry
        self.probe = self.record = None

    def start(self, parts, report, train_data):
        self.recorder = Telemetry(parts.model, self.model_cfg, parts.optimizer)
        self.report, self.state = report, parts.state
        last = parts.schedule.total_iters
        # an interval of a longer run kept in a config recorded nothing, in silence
        if last // self.interval * self.interval <= parts.state.iteration:
            print0(
                f"warning: telemetry_interval {self.interval}: no iteration of this run "
                f"({parts.state.iteration + 1}-{last}) is a multiple of it: no telemetry is recorded"
            )

    def before_step(self, it):
        self.record = None
        self.probe = self.recorder if it.number % self.interval == 0 else None
        if self.probe:
            self.probe.begin()

    def on_grads(self, model, loss_scale):
        if self.probe:
            self.probe.grads(loss_scale)

    def after_update(self):
        if self.probe:
            self.probe.updated()

    def check_step(self, it, step):
        if self.probe:  # finished before any replay of the step (Forensics comes after): the probes see the step
            self.record, self.probe = self.probe.finish(), None
            self.report.scalars(scalars(self.record), it.number, self.state)
            self.report.record(it.number, {"telemetry": self.record})
        return step
