"""Tests marked `cuda` need an NVIDIA GPU: skipped without one; with one, `python -m pytest -m cuda` runs them."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no NVIDIA GPU visible)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
