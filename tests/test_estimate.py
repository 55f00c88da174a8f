"""estimate.py (the dry run) sizes the GPU that needs the most: native ZeRO-1 deals out whole parameters."""
import io
import os

import arguments
import estimate
import parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_deal_out_gives_each_parameter_to_the_least_loaded_rank():
    assert parallel.deal_out([10, 3, 3, 3, 3, 1], 2) == [0, 1, 1, 1, 1, 0]
    assert parallel.deal_out([], 4) == []


def test_tr11_dry_run_reports_the_rank_with_the_embedding_shard():
    # stage 0 of TP 4 x PP 12 x DP 8: the 899M-element embedding shard's optimizer state (12 B each) on one rank
    cfg = arguments.load_config([os.path.join(ROOT, "config", "tr11_176b.py")])
    out = io.StringIO()
    result = estimate.dry_run(cfg, world_size=384, file=out)
    assert round(result["model_states"] / 2**30, 1) == 32.3
    assert "32.30 GiB on the largest rank (an even share would be 27.82 GiB)" in out.getvalue()
