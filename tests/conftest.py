import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed():
    # Tiny random models: a fixed seed keeps every test's model and data the same from run to run.
    torch.manual_seed(0)
