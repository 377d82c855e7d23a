"""opkit's modes standing aside while compiled code is built and run (core/suspend.py)."""

import torch

from lightning_opkit.core.suspend import SUSPENDED, suspending_backend


def test_the_backend_compiles_and_the_compiled_code_runs_inside_the_scope():
    depths = []

    def backend(gm, example_inputs):
        depths.append(("compile", SUSPENDED.depth))

        def run(*args):
            depths.append(("run", SUSPENDED.depth))
            return gm(*args)

        return run

    f = torch.compile(lambda x: x * 2, backend=suspending_backend(backend))
    assert f(torch.ones(2)).tolist() == [2.0, 2.0]
    assert depths == [("compile", 1), ("run", 1)]
    assert SUSPENDED.depth == 0  # and out again after


def test_what_dynamo_reads_off_a_backend_is_kept():
    eager = torch._dynamo.lookup_backend("eager")
    wrapped = suspending_backend(eager)
    for attr in ("compiler_name", "get_compiler_config", "reset"):
        assert hasattr(wrapped, attr) == hasattr(eager, attr)
