# Make the flat top-level modules (model, data, optim, ...) importable from tests/.
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(autouse=True)
def _unseeded_dropout_streams():
    """train.main seeds rng.py's model-parallel dropout stream, a module global: no test inherits another's."""
    yield
    import rng
    rng.set_states(None)
