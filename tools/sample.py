"""Generate text from a checkpoint.

    python tools/sample.py --load out/tiny --prompt "ROMEO:" [--max_tokens 200 --temperature 0.8 --top_k 200]

Reads DIR/latest, builds the model from the config stored in the checkpoint (no config file needed) and
samples on one process (CPU, or CUDA when available). A checkpoint whose model is split over tensor- or
pipeline-parallel ranks (TP or PP > 1) is refused: merge its shards into one first (checkpoint resharding).
"""
import argparse
import glob
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import checkpoint  # noqa: E402
import data  # noqa: E402
import parallel  # noqa: E402
import safety  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def load_model(directory, device):
    """(model, its training config) from DIR/latest, on device, in eval mode."""
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint directory {directory} does not exist")
    tag_dir = checkpoint.latest_dir(directory)
    if tag_dir is None:
        raise ValueError(f"{directory} holds no checkpoint (no '{checkpoint.LATEST}' file)")
    shards = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))
    config = safety.checkpoint_config(tag_dir)
    tp, pp = config["tensor_model_parallel_size"], config["pipeline_model_parallel_size"]
    if tp * pp > 1 or len(shards) != 1:
        raise ValueError(f"{tag_dir} holds a model split over TP={tp} x PP={pp} ranks ({len(shards)} shards); "
                         "tools/sample.py needs one shard: reshard the checkpoint to TP=PP=1 first")
    parallel.init(1, 1)
    cfg = GPTConfig.from_config(SimpleNamespace(**config))
    with torch.device(device):
        model = GPT(cfg)
    blob = torch.load(shards[0], map_location=device, weights_only=False)
    model.load_state_dict(blob["model"])
    return model.eval(), config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (the run's save directory)")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max_tokens", type=int, default=200, help="number of tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="divide the logits by this; lower: safer")
    parser.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens; 0: all")
    parser.add_argument("--num_samples", type=int, default=1, help="independent samples to print")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.temperature <= 0 or args.max_tokens < 0 or args.top_k < 0:
        raise ValueError("--temperature must be positive, --max_tokens and --top_k not negative")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, config = load_model(args.load, device)
    tok = data.get_tokenizer(config.get("tokenizer_file"))  # the run's tokenizer (GPT-2 BPE by default)
    prompt = tok.encode_ordinary(args.prompt) or [tok.eot_token]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    with torch.no_grad():
        for i in range(args.num_samples):
            out = model.generate(torch.tensor([prompt], device=device), args.max_tokens,
                                 temperature=args.temperature, top_k=args.top_k or None, generator=generator)
            print(("" if i == 0 else "-" * 60 + "\n") + tok.decode(out[0].tolist()), flush=True)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
