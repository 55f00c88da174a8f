"""Generate text from a checkpoint of any layout.

    python tools/sample.py --load out/tiny --prompt "ROMEO:" [--max_tokens 200 --temperature 0.8 --top_k 200]

Reads DIR/latest, builds the model from the config stored in the checkpoint (no config file needed) and
samples on one process (CPU, or CUDA when available). A checkpoint written by tensor- or pipeline-parallel ranks
is gathered into the one process as it loads (reshard.py), the vocabulary padding dropped.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import reshard  # noqa: E402
import tokenizer  # noqa: E402


def load_model(directory, device, tokenizer_file=None):
    """(model, tokenizer) from DIR/latest, the model on device, in eval mode; the tokenizer
    tokenizer_file's, by default the run's (GPT-2 BPE where it named none). The tokenizer first: a
    tokenizer_file not on this machine, or not the model's, is refused before the gather."""
    cfg, saved, _ = reshard.saved_model_config(directory)
    tok = tokenizer.run_tokenizer(saved.get("tokenizer_file"), tokenizer_file)
    tokenizer.check_vocab(tok, cfg.vocab_size)
    model, _, _ = reshard.load_full_model(directory)
    return model.to(device), tok


def check(args):
    """Refuse, before the checkpoint is read, a flag no sampling can follow: each named with its
    value (a --num_samples below 1 printed nothing and exited 0)."""
    for flag, value, bad, need in (
        ("--num_samples", args.num_samples, args.num_samples < 1, "at least 1"),
        ("--max_tokens", args.max_tokens, args.max_tokens < 0, "0 or more"),
        # not `<= 0`: a nan is no temperature either
        ("--temperature", args.temperature, not args.temperature > 0, "above 0"),
        ("--top_k", args.top_k, args.top_k < 0, "0 (all tokens) or more"),
    ):
        if bad:
            raise ValueError(f"{flag} {value} must be {need}")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--load", required=True, help="checkpoint directory (the run's save directory)"
    )
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max_tokens", type=int, default=200, help="number of tokens to generate")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="divide the logits by this; lower: safer"
    )
    parser.add_argument(
        "--top_k", type=int, default=200, help="sample among the k likeliest tokens; 0: all"
    )
    parser.add_argument("--num_samples", type=int, default=1, help="independent samples to print")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--tokenizer_file", default=None, help="tokenizer.json if not the checkpoint's own"
    )
    args = parser.parse_args(argv)
    check(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_model(args.load, device, args.tokenizer_file)
    prompt = tok.encode_ordinary(args.prompt) or [tok.eot_token]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    with torch.no_grad():
        for i in range(args.num_samples):
            out = model.generate(
                torch.tensor([prompt], device=device),
                args.max_tokens,
                temperature=args.temperature,
                top_k=args.top_k or None,
                generator=generator,
            )
            print(("" if i == 0 else "-" * 60 + "\n") + tok.decode(out[0].tolist()), flush=True)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
