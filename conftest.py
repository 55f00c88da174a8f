# Make the flat top-level modules (model, data, optim, ...) importable from tests/.
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("WANDB_MODE", "disabled")
