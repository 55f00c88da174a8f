# Make the flat top-level modules (model, data, optim, ...) importable from tests/.
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("WANDB_MODE", "disabled")
# The tests compare runs bit for bit: MKL's results independent of the threads it picks (what deterministic=True
# sets in train.py), set here before any test's first matrix product.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


@pytest.fixture(autouse=True)
def _unseeded_dropout_streams():
    """train.py's main seeds rng.py's model-parallel dropout stream, a module global: no test inherits another's."""
    yield
    import rng
    rng.set_states(None)
