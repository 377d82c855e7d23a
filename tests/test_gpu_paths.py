"""The CUDA paths, tested on a CPU with torch's own objects: profiler events of a GPU window (kernels and GPU
annotations on the device's timeline) fed through the real aggregation, fp16 gradients, the ``fp32_precision`` API,
device names for the datasheet. Each test is one defect a reading of the CUDA paths found."""

import inspect
import os

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent
from torch.utils import flop_counter

from lightning_opkit.nan.check import all_finite, check_step
from lightning_opkit.opclass import classify_profiler_event
from lightning_opkit.profiler.op_times import communication_time, summarize
from lightning_opkit.profiler.roofline.peaks import Peaks, datasheet, tf32_matmuls
from lightning_opkit.profiler.roofline.report import RooflineReport
from lightning_opkit.profiler.roofline.work import ClassRoofline, class_rooflines

CUDA = DeviceType.CUDA


class _Window:
    """A stopped profiler's two views, over events built by hand: what ``summarize`` and the roofline read."""

    def __init__(self, events: list[FunctionEvent]) -> None:
        self._events = EventList(events, use_device="cuda")
        self._events._build_tree()  # as torch.profiler does when it parses a trace: parents and children by time

    def events(self) -> EventList:
        return self._events

    def key_averages(self) -> EventList:
        return self._events.key_averages()


def _event(*args, **kwargs) -> FunctionEvent:
    """A ``FunctionEvent`` as the running torch's profiler makes it: before 2.13 it takes no ``input_dtypes`` (the
    profiler's kineto events carry them, and opkit copies them over: ``core/torch_compat.events_with_dtypes``)."""
    accepted = inspect.signature(FunctionEvent.__init__).parameters
    event = FunctionEvent(*args, **{k: v for k, v in kwargs.items() if k in accepted})
    for key, value in kwargs.items():
        if key not in accepted:
            setattr(event, key, value)
    return event


class _Trace:
    """Builds a GPU window as kineto reports it: CPU ops with their kernels appended, and each kernel again as a
    device event; ``record_function`` spans with a device-side twin (a GPU user annotation)."""

    def __init__(self) -> None:
        self.events: list[FunctionEvent] = []

    def cpu(self, name, start, end, *, kernel_us=0.0, annotation=False, shapes=None, dtypes=None, flops=None):
        event = _event(len(self.events) + 1, name, 1, start, end, use_device="cuda", stack=[],
                       input_shapes=shapes or [], input_dtypes=dtypes or [], is_user_annotation=annotation,
                       flops=flops)
        if kernel_us:
            event.append_kernel(f"kernel of {name}", 0, kernel_us)
        self.events.append(event)
        return event

    def device(self, name, start, end, *, annotation=False):
        self.events.append(_event(len(self.events) + 1, name, 7, start, end, use_device="cuda", stack=[],
                                  device_type=CUDA, is_user_annotation=annotation))

    def span(self, name, start, end, device_span):
        self.cpu(name, start, end, annotation=True)
        self.device(name, *device_span, annotation=True)


B, H, S, D = 2, 4, 128, 64
QKV = [[B, S, H, D]] * 4  # the flash kernels' own layout: [batch, seq, heads, dim]


def _gpu_step() -> _Trace:
    """One step of a GPU window: a GEMM, flash attention's backward, an Inductor kernel and a fused optimizer, inside
    the profiler's step span and an opkit region span, with their kernels on the device's timeline."""
    t = _Trace()
    t.cpu("ProfilerStep#3", 0, 1000, annotation=True)
    t.span("opkit region model.0", 10, 450, (100, 660))
    t.cpu("aten::linear", 20, 100)
    t.cpu("aten::addmm", 30, 90, kernel_us=200, shapes=[[256], [64, 128], [128, 256]], dtypes=["float"] * 3,
          flops=2 * 64 * 128 * 256)
    t.device("nvjet_sm90_gemm", 100, 300)
    t.cpu("aten::_scaled_dot_product_flash_attention_backward", 200, 300, shapes=[[B, H, S, D]] * 4,
          dtypes=["c10::BFloat16"] * 4)
    t.cpu("aten::_flash_attention_backward", 210, 290, kernel_us=300, shapes=QKV, dtypes=["c10::BFloat16"] * 4)
    t.device("flash_bwd_kernel", 300, 600)
    t.cpu("triton_poi_fused_add_gelu_0", 400, 420, kernel_us=50)  # Inductor's launch span, named after its kernel
    t.device("triton_poi_fused_add_gelu_0", 600, 650)
    t.span("Optimizer.step#AdamW.step", 500, 800, (650, 740))
    t.cpu("aten::_fused_adamw_", 510, 700, kernel_us=80)
    t.device("multi_tensor_apply_kernel", 650, 730)
    return t


def test_op_class_shares_count_each_kernel_once_on_the_device_timeline():
    report = summarize(_Window(_gpu_step().events), [1e-3], use_device=True)
    shares = {c: us for c, us in report.class_self_us.items() if us}
    # each kernel once, in its launcher's class; no GPU annotation (a whole span of other kernels) summed as work
    assert shares == {"matmul": 200.0, "attention": 300.0, "activation": 50.0, "other": 80.0}
    assert report.total_self_us == report.device_us == 630.0
    assert sum(report.class_percent().values()) == pytest.approx(100.0)
    # the region's device total is the kernels it launched, not the device annotation's row (0 on the CPU side)
    assert report.region_total_us == {"model.0": pytest.approx(550.0)}
    # host overhead of the framework spans stays apart, in host time
    assert report.framework_self_us > 0


def test_attention_backward_launches_kernels_in_the_attention_class():
    for name in ("aten::_flash_attention_backward", "aten::_efficient_attention_backward",
                 "aten::_cudnn_attention_backward", "aten::_cudnn_attention_forward",
                 "aten::_scaled_dot_product_cudnn_attention_backward"):
        assert classify_profiler_event(name) == "attention", name


def test_attention_flops_are_charged_to_the_op_whose_kernel_ran():
    rows = class_rooflines(_Window(_gpu_step().events), use_device=True)
    attention = rows["attention"]
    # its time is the backward kernel's (300 us), and its FLOPs those of that op's shapes: the parent, with ~0 device
    # time, does no work of its own
    assert attention.seconds == pytest.approx(300e-6)
    assert attention.calls == 1
    expected = flop_counter.sdpa_backward_flop_count(*[[B, H, S, D]] * 4)
    assert attention.flops == pytest.approx(expected)
    # Inductor's kernel once (its launch span), not again as a device row
    assert rows["activation"].unknown_seconds == pytest.approx(50e-6)
    assert rows["matmul"].seconds == pytest.approx(200e-6)


def test_attention_stays_under_its_peak():
    rows = class_rooflines(_Window(_gpu_step().events), use_device=True)
    flops_per_s = rows["attention"].flops / rows["attention"].seconds
    peaks = Peaks("cuda:0", {"bf16": flops_per_s * 2 / 1e12}, 4000.0)
    assert rows["attention"].pct_peak(peaks) == pytest.approx(50.0)


def test_exposed_communication_is_read_on_the_device_timeline():
    t = _Trace()
    t.cpu("c10d::allreduce_", 0, 10)  # launched early on the host: says nothing of when it ran
    t.cpu("aten::mm", 10, 20, kernel_us=200)
    t.device("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 100, 400)
    t.device("nvjet_sm90_gemm", 100, 300)
    t.span("DistributedDataParallel.forward", 0, 30, (0, 500))
    total, exposed = communication_time(_Window(t.events), use_device=True)
    assert total == pytest.approx(300.0)
    assert exposed == pytest.approx(100.0)  # 300-400: the NCCL kernel alone on the device


def test_large_finite_fp16_gradients_are_finite():
    big = [torch.full((10**6,), 100.0, dtype=torch.half)]  # its fp16 norm would be 1e5 > 65504
    assert bool(all_finite(big))
    assert check_step([torch.tensor(1.0)], big, torch.device("cpu")) == (False, False)
    huge = [torch.full((4,), 3e19)]  # finite, yet its fp32 norm overflows: the exact confirmation clears it
    assert check_step([], huge, torch.device("cpu")) == (False, False)
    assert check_step([], [torch.tensor([1.0, float("nan")], dtype=torch.half)], torch.device("cpu")) == (False, True)


def test_tf32_is_read_through_the_fp32_precision_api():
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"  # as transformers sets it; the legacy readers then raise
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()
        assert tf32_matmuls() is True
        matmul.fp32_precision = "ieee"
        assert tf32_matmuls() is False
    finally:
        matmul.fp32_precision = saved


@pytest.mark.parametrize("name, gbps, bf16", [
    ("NVIDIA H200", 4800.0, 989.0), ("NVIDIA GH200 480GB", 4000.0, 989.0), ("NVIDIA H100 NVL", 3900.0, 835.0),
    ("NVIDIA H100 80GB HBM3", 3350.0, 989.0), ("NVIDIA A100 80GB PCIe", 1935.0, 312.0),
    ("NVIDIA A100-SXM4-80GB", 2039.0, 312.0), ("NVIDIA A100-PCIE-40GB", 1555.0, 312.0)])
def test_datasheet_figures_by_device_name(name, gbps, bf16):
    sheet, bandwidth = datasheet(name)
    assert bandwidth == gbps
    assert sheet["bf16"] == bf16


def test_fp8_flops_are_not_charged_against_the_fp32_peak():
    peaks = Peaks("cuda:0", {"fp32": 50.0, "bf16": 800.0}, 4000.0)
    assert peaks.peak("fp8") == 0.0
    row = ClassRoofline("matmul", {"fp8": 1e12, "bf16": 1e12}, bytes=1e9, seconds=1e-2, calls=10)
    report = RooflineReport({"matmul": row}, peaks, steps=1, step_seconds=1e-2)
    assert report.mfu() == pytest.approx(100 * (1e12 / 800e12) / 1e-2)  # the bf16 part only: fp8 has no peak here
    sheet = Peaks("cuda:0", {"fp32": 50.0, "bf16": 800.0}, 4000.0, datasheet_tflops={"fp8": 1979.0})
    assert sheet.peak("fp8") == 1979e12


def test_fp16_candidates_are_judged_with_the_loss_scaled_as_training_scales_it():
    from torch import nn

    from lightning_opkit.precision import measure_precision

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    batch = torch.randn(32, 64)

    def cosine(scale):
        measured = measure_precision(model, lambda: batch, loss_fn=lambda m, b: m(b).mean() * 1e-6, dtypes=["fp16"],
                                     classes=["matmul"], loss_scale=scale, reps=1)
        return measured.get("matmul", "fp16").grad_cosine

    # unscaled, fp16 gradients of a small loss underflow and fp16 looks wrong; a GradScaler's 2**16 brings them back
    assert cosine(None) < 0.9
    assert cosine(2.0**16) > 0.9999


class _BadWhenCompiled(torch.nn.Module):
    """Identity eagerly; compiled, its output is NaN (as a miscompiled kernel would make it)."""

    def forward(self, x):
        return x * float("nan") if torch.compiler.is_compiling() else x


def test_a_fault_only_the_compiled_step_has_is_said_not_reproduced_in_an_eager_replay(tmp_path):
    from helpers import TinyNet, make_loader, trainer

    from lightning_opkit import NaNDetector, TorchCompile

    model = TinyNet()
    model.body[2] = torch.nn.Sequential(torch.nn.ReLU(), _BadWhenCompiled())
    detector = NaNDetector(action="skip", max_consecutive_skips=100)
    trainer(tmp_path, [detector, TorchCompile(modules=["body"], backend="eager")], max_steps=2).fit(
        model, make_loader())
    report = detector.events[0]
    assert report["cause"] == "transient"
    assert "not reproduced in an eager replay of a step that ran compiled" in report["advice"]


def test_the_loss_kept_for_the_check_is_a_copy_of_the_steps(tmp_path):
    # CUDA graphs (mode="reduce-overhead") reuse their output memory at the next replay: the check reads a copy
    from helpers import TinyNet, make_loader, trainer

    from lightning_opkit import NaNDetector

    seen = []

    class Keep(NaNDetector):
        def on_before_backward(self, trainer, pl_module, loss):
            super().on_before_backward(trainer, pl_module, loss)
            seen.append((loss, self._pending[-1].loss))

    trainer(tmp_path, [Keep()], max_steps=1).fit(TinyNet(), make_loader())
    loss, kept = seen[0]
    assert kept.data_ptr() != loss.data_ptr()
    assert torch.equal(kept, loss.detach())


def test_the_gpu_checks_refuse_to_pass_without_a_gpu(tmp_path):
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "gpu_checks.py")
    done = subprocess.run([sys.executable, script, "--report", str(tmp_path / "report.md")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1
    assert "FAIL: no CUDA device here; these checks need a GPU and nothing was checked" in done.stdout
