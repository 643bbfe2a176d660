"""Fixtures the unit tests of the engine share."""

import pytest
import torch

from pdserve.engine import load_model


@pytest.fixture(scope="module")
def tiny():
    """The built-in tiny model, seed 0 (one per test module: a test may not change it for the next module)."""
    torch.set_num_threads(1)
    return load_model("tiny", seed=0)
