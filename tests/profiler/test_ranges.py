"""Named ranges for Nsight Systems / VTune: counted through torch's own ITT API, balanced on every path."""

import pytest
import torch
from helpers import TinyNet, make_loader, snapshot, trainer
from observer import RangeObserver
from torch import nn
from zoo import build

from lightning_opkit import NaNDetector
from lightning_opkit.profiler.ranges import Ranges, range_functions
from lightning_opkit.profiler.windows import ProfilerWindows


def test_ranges_name_each_module_by_path_and_op_class_and_pop_what_a_raising_forward_left():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), Boom())
    ranges = Ranges(*range_functions("cpu"))
    ranges.attach(model)
    with RangeObserver() as seen:
        ranges.begin_step(7)
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.ones(1, 2))
        ranges.end_step()
    assert seen.names == ["opkit step 7", "Sequential [other]", "0 [matmul]", "1 [norm]", "2 [other]"]
    assert seen.balanced()
    ranges.detach()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_the_cuda_range_api_is_nvtx_and_a_cpu_build_offers_itt():
    push, pop = range_functions("cpu")
    assert (push, pop) == (torch.profiler.itt.range_push, torch.profiler.itt.range_pop)
    if torch.cuda.is_available():  # benchmarks/gpu_checks.py counts them on a GPU
        assert range_functions("cuda") == (torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop)
    else:
        assert range_functions("cuda") is None  # a CPU build has no NVTX: nothing is pushed, the fit goes on


def test_windows_ranges_run_only_in_windows_and_steps_ranges_on_every_step(tmp_path):
    for kind, steps in (("windows", {3, 4, 6, 7}), ("steps", set(range(8)))):
        model = build("hf_gpt2")
        before = snapshot(model)
        windows = ProfilerWindows(every_n_steps=3, warmup=1, active=1, ranges=kind, export_trace=False)
        with RangeObserver() as seen:
            trainer(tmp_path / kind, [windows], max_steps=8).fit(model, model.loader(n=32))
        assert seen.balanced()
        assert {int(n.split()[-1]) for n in seen.names if n.startswith("opkit step ")} == steps
        assert "model.transformer.h.0.attn [attention]" in seen.names
        assert "model.transformer.h.1.ln_2 [norm]" in seen.names
        assert windows.range_marks.pushed == len(seen.names)
        assert snapshot(model) == before  # every hook removed
        assert any(f"named ranges ({kind})" in line for line in windows.summary_lines())


def test_ranges_stay_balanced_over_a_skipped_step_and_an_exception(tmp_path):
    model = TinyNet(forward_steps=(2,))
    with RangeObserver() as seen:
        trainer(tmp_path / "skip", [ProfilerWindows(every_n_steps=2, warmup=0, active=2, ranges="steps"),
                                    NaNDetector(action="skip")], max_steps=4).fit(model, make_loader())
    assert seen.balanced()
    # the skipped step's replays ran inside its range too
    assert seen.names.count("body.0 [matmul]") > 4
    model = TinyNet(forward_steps=(2,))
    before = snapshot(model)
    with RangeObserver() as seen, pytest.raises(Exception, match="global step 2"):
        trainer(tmp_path / "raise", [ProfilerWindows(every_n_steps=2, warmup=0, active=2, ranges="steps"),
                                     NaNDetector(action="raise")], max_steps=4).fit(model, make_loader())
    assert seen.balanced()
    assert "opkit step 2" in seen.names
    assert snapshot(model) == before


def test_a_bad_ranges_value_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"`ranges` to be one of \['off', 'windows', 'steps'\], but got 'always'"):
        ProfilerWindows(ranges="always")


@pytest.mark.parametrize("regions", ["blocks", "whole"])
def test_modules_inside_a_compiled_region_get_no_range_and_windows_recompile_nothing(tmp_path, regions):
    """The demo's ViT, compiled by block with ranges in each window, recompiled each block once per window: the hooks
    on the modules inside the blocks failed dynamo's guard on their hooks (compiled whole, the LightningModule's
    forward: 19 graphs, 22 graph breaks). The observer: dynamo's own recompile log."""
    from observer import DynamoRecompiles

    from lightning_opkit import TorchCompile

    model = build("hf_gpt2")
    blocks = [n for n, _ in model.named_modules() if n.count(".") == 3 and ".h." in n]
    windows = ProfilerWindows(every_n_steps=3, warmup=0, active=1, ranges="windows", export_trace=False)
    compiler = TorchCompile(modules=["model.transformer.h.*"] if regions == "blocks" else None, backend="eager",
                            measure=False)
    with DynamoRecompiles() as recompiles, RangeObserver() as seen:
        trainer(tmp_path, [windows, compiler], max_steps=10).fit(model, model.loader(n=40))
    assert blocks
    modules = [n for n in seen.names if not n.startswith("opkit step ")]
    if regions == "blocks":
        assert all(any(n.startswith(f"{b} [") for n in seen.names) for b in blocks)  # each region has its range
        assert not [n for n in seen.names if any(n.startswith(f"{b}.") for b in blocks)]  # nothing inside one
    else:
        assert modules
        assert {n.split(" [")[0] for n in modules} == {type(model).__name__}  # the root's range alone
    assert seen.balanced()
    assert not recompiles.on_hooks(), recompiles.messages
