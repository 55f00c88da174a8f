# Make the flat top-level modules (model, data, optim, ...) importable from tests/.
import atexit
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("WANDB_MODE", "disabled")
# The tests compare runs bit for bit: MKL's results independent of the threads it picks (what deterministic=True
# sets in train.py), set here before any test's first matrix product.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# One intra-op thread in the test process and in what it starts (run_cli's train.py; launch and spawn set it too):
# the tests' shapes are tiny, so a second thread buys little even on a quiet machine, while on a busy one (or two
# xdist workers on 2 cores) two spinning OpenMP threads per process make each small op up to 40x slower. Bit-exact
# comparisons are between runs made under this same setting. OMP_NUM_THREADS=N python -m pytest overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# transformers copies an exported model's remote code into its modules cache (not atomically): each test process
# its own, so that two xdist workers loading exports at once never read a half-copied file, and none in ~/.cache
_modules = tempfile.mkdtemp(prefix="hf_modules_")
atexit.register(shutil.rmtree, _modules, ignore_errors=True)
os.environ["HF_MODULES_CACHE"] = _modules
import torch  # noqa: E402 (after the environment it reads)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _unseeded_dropout_streams():
    """train.py's main seeds rng.py's model-parallel dropout stream, a module global: no test inherits another's."""
    yield
    import rng

    rng.set_states(None)
