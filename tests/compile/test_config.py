"""TorchCompile's arguments (compile/config.py), checked at construction without a Trainer: the backends torch has,
Inductor options by name, and a backend that stands opkit's precision mode aside while it compiles."""

import pytest
import torch

from lightning_opkit.compile.config import backends, check_compile_args, make_backend


def test_the_backends_are_torch_s_own():
    assert {"inductor", "eager", "aot_eager"} <= set(backends())
    assert set(torch._dynamo.list_backends()) <= set(backends())


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(backend="inductr"), r"`backend`.*'inductor'.*'inductr'"),
     (dict(mode="fast"), r"`mode`.*'max-autotune'.*'fast'"),
     (dict(options={"max_autotune": "yes"}), r"max_autotune"),
     (dict(dynamic="yes"), "`dynamic`")],
)
def test_a_bad_argument_is_refused_naming_it_and_what_is_valid(kwargs, match):
    args = dict(modules=None, backend="inductor", mode=None, options=None, dynamic=None, on_recompile_limit="warn")
    with pytest.raises(ValueError, match=match):
        check_compile_args(**(args | kwargs))


def test_a_made_backend_compiles_and_runs_as_torch_compile_would():
    backend = make_backend("eager", None, None, None)
    compiled = torch.compile(lambda x: x.sin() + 1, backend=backend)
    assert torch.allclose(compiled(torch.ones(3)), torch.ones(3).sin() + 1)
