"""One compiled region at run time (compile/compiled_forward.py), Trainer-free: its calls counted and run compiled
(dynamo's own cache says so), a compile failure rerun eagerly and reported, a region measured slower compiled
switched to eager on its own calls."""

import time

import torch
import torch._dynamo
from torch import nn

from lightning_opkit.compile.compiled_forward import CompiledForward, RegionHooks, speed_trial
from lightning_opkit.compile.regions import Region
from lightning_opkit.compile.watch import DynamoWatch
from lightning_opkit.core.dynamo_compat import cache_entries, compiled_code


def _region(backend, **hooks):
    torch._dynamo.reset()
    module = nn.Linear(4, 4)
    original = module.forward
    compiled = torch.compile(original, backend=backend)
    region = Region("layer", code=compiled_code(compiled))
    reported: dict[str, list] = {"failure": [], "slower": [], "recompile": []}
    forward = CompiledForward(module, region, original, compiled, DynamoWatch(), RegionHooks(
        on_failure=reported["failure"].append, on_recompile=reported["recompile"].append,
        on_slower=reported["slower"].append, **hooks))
    return module, forward, region, reported


def test_calls_run_the_compiled_code_and_are_counted():
    module, forward, region, reported = _region("eager")
    x = torch.randn(2, 4)
    for _ in range(3):
        assert torch.allclose(forward(x), module(x))
    assert region.calls == 3
    assert cache_entries(region.code) == 1  # dynamo compiled it once and ran that
    assert reported == {"failure": [], "slower": [], "recompile": []}
    with torch.profiler.profile() as prof:
        forward(x)
    assert "opkit region layer" in {e.name for e in prof.events()}


def test_a_compile_failure_is_reported_and_the_call_runs_eagerly():
    def broken(gm, example_inputs):
        raise RuntimeError("backend broke")

    module, forward, _, reported = _region(broken)
    x = torch.randn(2, 4)
    assert torch.equal(forward(x), module(x))
    assert len(reported["failure"]) == 1
    assert "backend broke" in str(reported["failure"][0])


def test_a_region_slower_compiled_than_eager_is_switched_to_eager_by_its_own_calls():
    ran_compiled = []

    def slow(gm, example_inputs):
        def run(*args):
            ran_compiled.append(1)
            time.sleep(0.05)  # compiled code 50 ms a call: far slower than the eager Linear, busy machine or not
            return gm(*args)

        return run

    module, forward, region, reported = _region(slow, speedup=True, eager_if_slower=True)
    x = torch.randn(2, 4, requires_grad=True)
    calls = 0
    while region.speedup is None and calls < 20:
        forward(x)
        calls += 1
    assert calls == 8  # two warm-up calls, then three rounds of compiled and eager: no extra calls
    assert region.speedup < 0.5
    assert region.slower
    assert reported["slower"] == [region]
    before = len(ran_compiled)
    forward(x)
    forward(x)
    assert len(ran_compiled) == before  # eager from now on: the compiled code is not run
    trial = speed_trial()
    assert [trial.next() for _ in range(4)] == ["warmup", "warmup", "compiled", "eager"]
