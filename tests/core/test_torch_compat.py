"""The torch and Lightning names opkit calls, private ones included: one place that says what a new (or an older)
release must still have, run on whichever torch runs the suite (`make test-torch TORCH=2.9.1` for another). The floors
in pyproject.toml are the oldest releases the suite was run on: torch 2.9 (docs/versions.md has the table) and
Lightning 2.6; CI runs what constraints.txt pins."""

import importlib
import math
import re

import pytest
import tomllib
import torch
from packaging.version import Version
from torch.overrides import TorchFunctionMode

from lightning_opkit import __file__ as package_file
from lightning_opkit.core.torch_compat import (
    ConvNd,
    DropoutNd,
    Loss,
    NormBase,
    event_list,
    foreach_copy_,
    foreach_non_finite_check_,
    foreach_norm,
    function_mode_stack,
    mark_scheduler_wrapped,
    profiler_enabled,
    scaler_tensors,
)

NAMES = [
    # dynamo and Inductor: TorchCompile, the policy's mode, the precision auto-measurement
    "torch.compiler.set_stance", "torch.compiler.is_compiling", "torch._dynamo.config.patch",
    "torch._dynamo.callback_handler.register_start_callback", "torch._dynamo.callback_handler.remove_end_callback",
    "torch._dynamo.utils.counters", "torch._dynamo.eval_frame.skip_code", "torch._dynamo.eval_frame._stance",
    "torch.compiler.assume_constant_result", "torch._dynamo.lookup_backend", "torch.compiler.list_backends",
    "torch._C._dynamo.eval_frame._debug_get_cache_entry_list", "torch._logging._internal.log_state",
    "torch._TorchCompileInductorWrapper", "torch._TorchCompileWrapper", "torch._inductor.config.get_config_copy",
    "torch._inductor.list_mode_options", "torch._dynamo.exc.FailOnRecompileLimitHit",
    # profiler windows and the roofline
    "torch.profiler.ProfilerAction", "torch.autograd.profiler._is_profiler_enabled", "torch.autograd.DeviceType",
    "torch.autograd.profiler_util.FunctionEvent", "torch.utils.flop_counter.sdpa_flop_count",
    "torch.utils.flop_counter.sdpa_backward_flop_count", "torch.utils.flop_counter.conv_backward_flop",
    # the check, replays, sharded training
    "torch._foreach_norm", "torch._foreach_copy_", "torch._amp_foreach_non_finite_check_and_unscale_",
    "torch.utils._pytree.tree_map", "torch.utils._pytree.tree_leaves",
    "torch.distributed.fsdp.FSDPModule", "torch.cuda.Event", "torch.cuda.Event.query", "torch.cuda.Event.synchronize",
    "torch.overrides.TorchFunctionMode", "torch.backends.cuda.matmul.fp32_precision",
    # the memory view, activation checkpointing, the snapshot on out of memory
    "torch.cuda.memory._record_memory_history", "torch.cuda.memory._dump_snapshot", "torch.OutOfMemoryError",
    "torch.utils.checkpoint.create_selective_checkpoint_contexts", "torch.autograd.graph.saved_tensors_hooks",
    "torch.channels_last", "torch.channels_last_3d",
    # the compat module, the policy's mode around higher-order operators, checkpoints outside a compiled graph
    "torch.utils._python_dispatch._disable_current_modes", "torch._ops.HigherOrderOperator", "torch.compiler.disable",
    "torch.utils.checkpoint.CheckpointPolicy", "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.overrides._get_current_function_mode_stack", "torch.autograd.profiler_util.EventList",
    # the taxonomy's module base classes
    "torch.nn.modules.conv._ConvNd", "torch.nn.modules.batchnorm._NormBase", "torch.nn.modules.loss._Loss",
    "torch.nn.modules.dropout._DropoutNd",
]


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("name", NAMES)
def test_the_names_opkit_calls_exist(name):
    assert _resolve(name) is not None


def test_foreach_norm_takes_a_result_dtype():
    # the per-step check's norms in fp32, whatever the gradients' dtype
    (norm,) = foreach_norm([torch.ones(4, dtype=torch.half)], 2, dtype=torch.float32)
    assert norm.dtype == torch.float32
    assert list(foreach_norm([torch.tensor([3.0, -4.0])], math.inf)) == [torch.tensor(4.0)]


def test_foreach_non_finite_check_sets_its_flag_and_rewrites_by_a_factor_of_one_bit_for_bit():
    tensors = [torch.tensor([1.5, -0.0], dtype=torch.bfloat16), torch.tensor([2.0, float("inf")])]
    found = torch.zeros(1)
    foreach_non_finite_check_(tensors, found, torch.ones(()))
    assert found.tolist() == [1.0]
    assert tensors[0].tolist() == [1.5, -0.0]
    assert str(tensors[0][1].item()) == "-0.0"
    halved = [torch.tensor([4.0])]
    foreach_non_finite_check_(halved, found.zero_(), torch.tensor(0.5))  # what GradScaler's unscale is for
    assert (halved[0].tolist(), found.tolist()) == ([2.0], [0.0])


def test_foreach_copy_writes_in_place():
    destinations = [torch.zeros(2), torch.zeros(3)]
    alias = destinations[1]
    foreach_copy_(destinations, [torch.ones(2), torch.full((3,), 2.0)])
    assert alias.tolist() == [2.0, 2.0, 2.0]


def test_the_function_mode_stack_and_the_profiler_flag_are_read_as_they_are():
    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert function_mode_stack() == []
    with Mode() as mode:
        assert function_mode_stack() == [mode]
    assert not profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert profiler_enabled()
    assert not profiler_enabled()


def test_a_grad_scalers_state_tensors_are_its_scale_and_growth_tracker():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert scaler_tensors(scaler) == []  # made at its first scale
    scaler.scale(torch.ones(()))
    scale, tracker = scaler_tensors(scaler)
    assert scale.item() == scaler.get_scale() == 8.0
    assert tracker.item() == 0


def test_a_wrapped_step_keeps_the_lr_schedulers_mark(recwarn):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    step = opt.step
    wrapped = lambda *args, **kwargs: step(*args, **kwargs)  # noqa: E731
    mark_scheduler_wrapped(step, wrapped)
    opt.step = wrapped
    opt.step()
    sched.step()
    assert not [w for w in recwarn if "optimizer.step()" in str(w.message)]  # torch warns on an unmarked override


def test_the_taxonomy_s_module_bases_are_torch_s():
    assert isinstance(torch.nn.Conv2d(1, 1, 1), ConvNd)
    assert isinstance(torch.nn.BatchNorm1d(2), NormBase)
    assert isinstance(torch.nn.MSELoss(), Loss)
    assert isinstance(torch.nn.Dropout(), DropoutNd)


def test_an_event_list_of_some_events_keeps_their_settings():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).sum()
    events = prof.events()
    kept = event_list(events, list(events)[:1])
    assert len(kept) == 1
    assert getattr(kept, "_use_device", None) == getattr(events, "_use_device", None)


def test_conv_backward_flop_formula_is_reachable_unregistered():
    from torch.utils import flop_counter

    assert callable(flop_counter.conv_backward_flop.__wrapped__)


def test_a_late_replay_can_run_as_of_its_step():
    # NaNDetector(decide="device") replays a step late: Lightning's global_step must be the optimizer progress's count
    import lightning.pytorch as pl

    from lightning_opkit.nan.device import as_of_step

    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with as_of_step(trainer, 7):
        assert trainer.global_step == 7
    assert trainer.global_step == 0


def test_fused_optimizers_take_found_inf():
    # a 0-d found_inf leaves a fused AdamW's update, weight decay and step count out
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=1.0, weight_decay=0.5, fused=True)
    p.grad = torch.ones(3)
    opt.step()
    state = {k: v.clone() for k, v in opt.state[p].items()}
    before = p.detach().clone()
    opt.found_inf, opt.grad_scale = torch.ones(()), None
    opt.step()
    assert torch.equal(p, before)
    assert all(torch.equal(v, opt.state[p][k]) for k, v in state.items())


def test_the_declared_floors_are_met_here():
    with open(package_file.replace("lightning_opkit/__init__.py", "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    floors = dict(re.match(r"([a-z_]+)(?:\[\w+\])?>=([\d.]+)", d).groups() for d in deps if ">=" in d)
    assert Version(floors["torch"]) == Version("2.9")  # the oldest release docs/versions.md says was run
    assert Version(torch.__version__.split("+")[0]) >= Version(floors["torch"])
    import lightning

    assert Version(lightning.__version__) >= Version(floors["lightning"])


def test_profiler_events_carry_their_input_dtypes_and_allocations_on_this_torch():
    # torch before 2.13 has no FunctionEvent.input_dtypes: the compat module copies them from the kineto events
    from lightning_opkit.core.torch_compat import cpu_memory_events, events_with_dtypes

    a = torch.ones(16, 16, dtype=torch.bfloat16)
    with torch.profiler.profile(record_shapes=True, profile_memory=True) as prof:
        (a @ a).float().sum()
    mm = [e for e in events_with_dtypes(prof) if e.key == "aten::mm"]
    assert mm
    assert mm[0].input_dtypes[:2] == ["c10::BFloat16", "c10::BFloat16"]
    allocations = cpu_memory_events(prof)
    assert allocations is not None
    assert any(n == 16 * 16 * 2 for _, n in allocations)  # the product's bytes, allocated
