import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed_and_cold_dynamo():
    # Tiny random models: a fixed seed keeps every test's model and data the same from run to run. Dynamo's cache
    # is per code object, shared by every instance of a class: reset it so compile counts do not depend on order.
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
    # A stance left forced would make every later test run its compiled regions eagerly, and pass or fail for it.
    from torch._dynamo.eval_frame import _stance

    left = _stance.stance
    if left != "default":
        torch.compiler.set_stance("default")
        pytest.fail(f"the test left dynamo's stance at {left!r}")
