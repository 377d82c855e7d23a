"""The checks that need a GPU: one strict, short run on a lent CUDA machine, PASS/FAIL per check, exit 1 on any FAIL.

    PYTHONPATH=. python3 benchmarks/gpu_checks.py [--report PATH]     # about 3-5 minutes on one H200

Runs on that machine's own Python (torch >= 2.11, Lightning, TensorBoard, matplotlib; no jsonargparse, nothing
installed). Without CUDA it exits 1 and says why: a check that cannot run has not passed.

Each check holds an invariant that today's defects would break, read independently of the code under test where it
can be (the exported Chrome trace, CUDA's sync debug mode, the datasheet):

1. ``device time``: a profiler window's op-class shares, eager and compiled (Inductor), against the window's own
   trace. Every kernel counted once (class time = the trace's kernel, copy and memset time, within 2%), class time per
   step <= step time, shares sum to 100 +- 2, every op named ``*attention*`` (forward and backward) in the attention
   class. Counting device rows and GPU annotations beside the ops that launched them (the old reading) gives about
   twice the trace's kernel time and a class time above the step time; attention's backward in ``other`` fails the
   last.
2. ``roofline``: attention at <= 100% of its dtype's peak (its FLOPs charged to the op whose kernel ran, not to a
   parent with no device time, which read ~3x high), matmul achieving TFLOP/s, MFU in (0, 100].
3. ``peaks``: measured bf16 GEMM and copy bandwidth within 2x of the datasheet; what measuring reserved in the caching
   allocator handed back.
4. ``auto``: ``rules="auto"`` on a d_model=1024 LM under 32-true runs its GEMMs in bf16 (op timings are N calls
   between CUDA events, not one op between two syncs, which measured launch latency and kept fp32).
5. ``one sync``: a NaN-checked step adds exactly one host synchronization (``torch.cuda.set_sync_debug_mode``), and
   with ``decide="device"`` none; what each costs per step, measured side by side (the stall of the one sync).
6. ``16-true``: finite fp16 gradients whose norm passes 65504 raise nothing.
7. ``NaN named``: a NaN written into one module's output is named there under bf16-mixed and 16-mixed, and with
   ``decide="device"`` (its update left out by the fused AdamW on the device, the weights unchanged).
8. ``fp16 + GradScaler``: a fp16 matmul policy under 16-mixed trains finite, with its census.
9. ``cudagraphs``: ``TorchCompile(mode="reduce-overhead")`` with ``NaNDetector`` trains without falling back, no
   false event.
10. ``memory_breakdown``: the memory view's peak is the allocator's, its activations positive;
    ``ActivationCheckpointing`` on every block cuts them by 40% or more; a fit that runs out of memory leaves a
    snapshot that loads, with segments.
11. ``fp8``: on a d_model=4096 LM with a narrow (4096 x 8) router beside its blocks, ``rules="auto"`` measures each
    Linear in float8 and runs every wide MLP Linear in it, the router in bf16, named; with the blocks compiled
    (Inductor) the median step is faster than bf16-mixed's with the same compile, interleaved (A B B A). On a GPU
    below compute capability 8.9 auto tries no float8 and says why. Needs torchao (``pip install
    'lightning_opkit[fp8]'``, or its wheel unpacked on ``PYTHONPATH``): without it, FAIL.
12. ``NVTX ranges``: ``ProfilerWindows(ranges="steps")`` pushes its ranges through ``torch.cuda.nvtx`` (counted with
    ``sys.setprofile``, nothing of opkit's read): one per step and module forward, every push popped.
13. ``autocast table``: where the policy's table is what autocast does, its eager step at d_model 128 (launch-bound)
    is within 5% of plain bf16-mixed's, interleaved (A B A B), with no TorchFunctionMode active on a non-census step;
    the built-in table (the mode) is printed beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_opkit import (  # noqa: E402
    ActivationCheckpointing,
    NaNDetector,
    PrecisionPolicy,
    ProfilerWindows,
    TorchCompile,
)

KERNEL_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


class Block(nn.Module):
    """A pre-norm transformer block with PyTorch's fused attention (flash or cuDNN kernels on a GPU)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


class Poison(nn.Module):
    """Identity, except at global step ``at``: a NaN written into its output."""

    def __init__(self) -> None:
        super().__init__()
        self.at, self.step = -1, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step == self.at:
            x = x.clone()
            x.view(-1)[0] = math.nan
        return x


class LM(pl.LightningModule):
    """A causal LM on random tokens: embedding, ``layers`` blocks, a head; no ``self.log`` (no syncs of its own)."""

    def __init__(self, d: int = 512, layers: int = 4, heads: int = 8, vocab: int = 4096, seq: int = 256,
                 batch: int = 8, lr: float = 1e-4, poison_at: int = -1) -> None:
        super().__init__()
        self.vocab, self.seq, self.batch, self.lr = vocab, seq, batch, lr
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.poison = Poison()
        self.poison.at = poison_at
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.poison.step = self.global_step
        x = self.embed(ids)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0:
                x = self.poison(x)
        return self.head(self.norm(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)

    def loader(self, steps: int) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab, (steps * self.batch, self.seq + 1), generator=g)
        return DataLoader(TensorDataset(ids), batch_size=self.batch)


def fit(model: LM, callbacks: list[pl.Callback], steps: int, root: str, **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(default_root_dir=root, accelerator="cuda", devices=1, max_steps=steps, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         logger=pl.loggers.TensorBoardLogger(root), num_sanity_val_steps=0, limit_val_batches=0,
                         **kwargs)
    torch.manual_seed(0)
    trainer.fit(model, model.loader(steps))
    return trainer


def trace_kernel_us(path: str) -> float:
    """Microseconds of kernels, copies and memsets in a Chrome trace (each device event once)."""
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        events = json.load(f)["traceEvents"]
    return sum(float(e.get("dur", 0)) for e in events if e.get("cat") in KERNEL_CATEGORIES)


class Check:
    """One PASS/FAIL line and its figures, for the console and the report."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.failures: list[str] = []

    def expect(self, ok: bool, what: str) -> None:
        self.lines.append(("ok   " if ok else "FAIL ") + what)
        if not ok:
            self.failures.append(what)

    def note(self, text: str) -> None:
        self.lines.append("     " + text)


def check_device_time(c: Check, root: str, compiled: bool) -> None:
    """Check 1 (and 2 on the eager run): a window's shares against its own trace; the roofline."""
    model = LM()
    windows = ProfilerWindows(every_n_steps=6, warmup=1, active=2, roofline=not compiled)
    callbacks: list[pl.Callback] = [windows] + ([TorchCompile(modules="auto")] if compiled else [])
    fit(model, callbacks, 9, root, precision="bf16-mixed")
    report = windows.last_report
    assert report is not None, "no window closed"
    kernels = trace_kernel_us(windows.trace_files[-1])
    total = report.total_self_us
    c.note(f"window: {report.steps} steps of {report.step_time_ms:.2f} ms; class device time {total / 1e3:.3f} ms,"
           f" the trace's kernels {kernels / 1e3:.3f} ms; shares " + ", ".join(
               f"{k} {v:.1f}%" for k, v in sorted(report.class_percent().items(), key=lambda kv: -kv[1]) if v > 0.5))
    c.expect(0.98 * kernels <= total <= 1.02 * kernels, "every kernel counted once: class time = the trace's kernel"
             " time within 2%")
    c.expect(total / report.steps <= 1e3 * report.step_time_ms * 1.01, "class time per step <= step time")
    c.expect(abs(sum(report.class_percent().values()) - 100) <= 2, "shares sum to 100 +- 2")
    attention = [r for r in report.ops if "attention" in r.name.lower() and r.self_us > 0]
    c.expect(bool(attention) and all(r.op_class == "attention" for r in attention),
             "every *attention* op with device time is in the attention class: "
             + ", ".join(f"{r.name} ({r.op_class})" for r in attention[:4]))
    c.expect(any("backward" in r.name for r in attention), "attention's backward kernels counted in attention")
    if compiled:
        fused = [r for r in report.ops if r.name.startswith("triton_")]
        c.expect(bool(fused), f"Inductor's kernels seen: {len(fused)} triton kernels with device time")
        return
    roof = windows.last_roofline
    assert roof is not None, "the roofline failed"
    att, mm = roof.rows.get("attention"), roof.rows.get("matmul")
    c.note(f"roofline: matmul {mm.tflops if mm else 0:.1f} TFLOP/s ({mm.dtype if mm else '-'}), attention"
           f" {att.pct_peak(roof.peaks) if att else 0:.1f}% of its peak, MFU {roof.mfu() or 0:.1f}%")
    c.expect(att is not None and 0 < att.pct_peak(roof.peaks) <= 100, "attention at <= 100% of its peak")
    c.expect(mm is not None and mm.tflops > 1, "matmul achieves > 1 TFLOP/s")
    mfu = roof.mfu()
    c.expect(mfu is not None and 0 < mfu <= 100, f"MFU in (0, 100]: {mfu}")
    from lightning_opkit.profiler.roofline.view import roofline_table

    c.lines.append("\n" + roofline_table(roof) + "\n")


def check_peaks(c: Check, root: str) -> None:
    """Check 3: measured peaks against the datasheet; the allocator handed back."""
    from lightning_opkit.profiler.roofline.peaks import measure_peaks, tf32_matmuls

    model = torch.empty(2**29, device="cuda")  # 2 GiB beside the measurement, as a model would be
    before = torch.cuda.memory_reserved()
    peaks = measure_peaks("cuda", ("fp32", "bf16"))
    after = torch.cuda.memory_reserved()
    del model
    c.note(peaks.describe() + f"; TF32 matmuls: {tf32_matmuls()}")
    sheet = peaks.datasheet_tflops
    c.expect(bool(sheet), f"a datasheet for {torch.cuda.get_device_name()}")
    if sheet:
        ratio = peaks.gemm_tflops["bf16"] / sheet["bf16"]
        c.expect(0.5 <= ratio <= 2, f"bf16 GEMM {peaks.gemm_tflops['bf16']:.0f} TFLOP/s within 2x of the datasheet's"
                 f" {sheet['bf16']:.0f} ({ratio:.2f})")
        bw = peaks.bandwidth_gbps / (peaks.datasheet_gbps or 1)
        c.expect(0.5 <= bw <= 2, f"copy {peaks.bandwidth_gbps:.0f} GB/s within 2x of {peaks.datasheet_gbps} ({bw:.2f})")
    c.expect(after <= before + 256 * 2**20, f"the caching allocator handed back: reserved {before / 2**30:.2f} ->"
             f" {after / 2**30:.2f} GiB")


def check_auto(c: Check, root: str) -> None:
    """Check 4: rules="auto" runs an LM's GEMMs in bf16 at d_model 1024."""
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=0)
    t0 = time.perf_counter()
    fit(LM(d=1024, layers=4, heads=16, seq=512, batch=8), [policy], 14, root, precision="32-true")
    c.note(f"fit of 14 steps with the measurement: {time.perf_counter() - t0:.1f} s; measured in"
           f" {policy.measure_seconds:.1f} s; " + "; ".join(policy.summary_lines()))
    row = policy.measurements.get("matmul", "bf16") if policy.measurements else None
    c.note(f"matmul bf16 per-op speed vs fp32: {row.time_ratio if row else None}")
    choice = policy.choice
    gemms_bf16 = policy.table.get("matmul") == "bf16" or bool(choice and choice.best.autocast == "bf16")
    c.expect(gemms_bf16, f"GEMMs in bf16 (table matmul={policy.table.get('matmul')},"
             f" chosen {choice.chosen if choice else '-'})")
    ratio = row.time_ratio if row is not None else None
    c.expect(ratio is not None and ratio < 1, "bf16 matmul timed faster than fp32")


class SyncCount(pl.Callback):
    """Counts CUDA's sync warnings (``set_sync_debug_mode("warn")``) and times steps, from step ``start`` on."""

    def __init__(self, start: int) -> None:
        self.start, self.syncs, self.steps, self.ms = start, 0, 0, []
        self._catch: Any = None
        self._t0: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step >= self.start:
            torch.cuda.synchronize()
            self._t0 = time.perf_counter()
            self._catch = warnings.catch_warnings(record=True)
            self._seen = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any,
                           i: int) -> None:
        if self._catch is not None:
            torch.cuda.set_sync_debug_mode(0)
            self.syncs += sum("synchronizing CUDA operation" in str(w.message) for w in self._seen)
            self._catch.__exit__(None, None, None)
            self._catch = None
            self.steps += 1
            torch.cuda.synchronize()
            self.ms.append(1e3 * (time.perf_counter() - self._t0))


def check_one_sync(c: Check, root: str) -> None:
    """Check 5: a NaN-checked step adds exactly one host sync, none with decide="device"; the cost of each per step."""
    runs: dict[str, SyncCount] = {}
    detectors: dict[str, Callable[[], list[pl.Callback]]] = {
        "without": list, "host": lambda: [NaNDetector(action="skip")],
        "device": lambda: [NaNDetector(action="skip", decide="device")]}
    for name in ("without", "host", "device", "without again", "host again", "device again"):
        counter = SyncCount(start=3)
        cbs = [counter, *detectors[name.split()[0]]()]
        fit(LM(d=1024, layers=4, heads=16, seq=512, batch=8), cbs, 13, os.path.join(root, name), precision="bf16-mixed")
        runs[name] = counter
    per_step = {n: r.syncs / max(r.steps, 1) for n, r in runs.items()}
    c.note("host syncs per step: " + ", ".join(f"{n} {v:.2f}" for n, v in per_step.items()))
    added = {kind: [per_step[f"{kind}{again}"] - per_step[f"without{again}"] for again in ("", " again")]
             for kind in ("host", "device")}
    c.expect(added["host"] == [1.0, 1.0], f"decide='host': a checked step adds exactly one host sync {added['host']}")
    c.expect(added["device"] == [0.0, 0.0], f"decide='device': a checked step adds no host sync {added['device']}")
    median = {kind: statistics.median(runs[kind].ms + runs[f"{kind} again"].ms)
              for kind in ("without", "host", "device")}
    c.note(f"d_model 1024 LM, bf16-mixed, fused AdamW, median step: {median['without']:.2f} ms without NaNDetector,"
           f" {median['host']:.2f} ms decide='host' ({median['host'] / median['without']:.3f}x),"
           f" {median['device']:.2f} ms decide='device' ({median['device'] / median['without']:.3f}x)")


class BigGrads(pl.LightningModule):
    """fp16 weights whose gradients are finite element by element (16384 each) but whose norm passes 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1024, 1024, bias=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.layer(x).float().sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def loader(self, steps: int) -> DataLoader:
        return DataLoader(TensorDataset(torch.full((steps * 4096, 1024), 4.0)), batch_size=4096)


def check_16_true(c: Check, root: str) -> None:
    """Check 6: large finite fp16 gradients raise nothing under 16-true."""
    detector = NaNDetector(action="raise")
    model = BigGrads()
    fit(model, [detector], 3, root, precision="16-true")  # type: ignore[arg-type]
    grad_norm = float(model.layer.weight.grad.float().norm()) if model.layer.weight.grad is not None else 0.0
    c.expect(not detector.events, f"no event; the last gradient's norm {grad_norm:.3g} > 65504, every element finite")


def check_nan_named(c: Check, root: str) -> None:
    """Check 7: a NaN in one module's output named there under bf16-mixed and 16-mixed."""
    for precision in ("bf16-mixed", "16-mixed"):
        detector = NaNDetector(action="skip")
        fit(LM(d=256, layers=2, heads=4, poison_at=2), [detector], 4, os.path.join(root, precision),
            precision=precision)
        first = detector.events[0] if detector.events else {}
        c.note(f"{precision}: {first.get('step')} {first.get('phase')} {first.get('module')!r} {first.get('cause')}")
        c.expect(first.get("module") == "poison" and first.get("phase") == "forward" and first.get("step") == 2,
                 f"{precision}: the NaN named at module 'poison', forward, step 2")
    detector = NaNDetector(action="skip", decide="device")
    weights: dict[str, torch.Tensor] = {}

    class Before(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
            if trainer.global_step in (2, 3):
                weights[str(trainer.global_step)] = pl_module.head.weight.detach().clone()

    fit(LM(d=256, layers=2, heads=4, poison_at=2), [detector, Before()], 4, os.path.join(root, "device"),
        precision="bf16-mixed")
    first = detector.events[0] if detector.events else {}
    unchanged = len(weights) == 2 and torch.equal(weights["2"], weights["3"])
    c.note(f"decide='device': {first.get('step')} {first.get('phase')} {first.get('module')!r}; weights unchanged"
           f" over the bad step: {unchanged}")
    c.expect(first.get("module") == "poison" and first.get("step") == 2 and unchanged,
             "decide='device': the NaN named at 'poison', step 2, its update left out on the device")


def check_fp16_scaler(c: Check, root: str) -> None:
    """Check 8: fp16 matmuls under 16-mixed with Lightning's GradScaler train finite."""
    policy = PrecisionPolicy(rules={"matmul": "fp16"}, census_every_n_steps=5)
    detector = NaNDetector(action="raise")
    trainer = fit(LM(d=256, layers=2, heads=4), [policy, detector], 12, root, precision="16-mixed")
    finite = all(bool(torch.isfinite(p).all()) for p in trainer.lightning_module.parameters())
    c.note(f"census {sorted(policy.census)}; scale {trainer.precision_plugin.scaler.get_scale()}")
    c.expect(finite and ("matmul", "fp16") in policy.census and not detector.events,
             "finite weights, matmul counted in fp16, no event")


def check_cudagraphs(c: Check, root: str) -> None:
    """Check 9: reduce-overhead (CUDA graphs) with NaNDetector: no fallback, no false event."""
    compiler = TorchCompile(modules="auto", mode="reduce-overhead")
    detector = NaNDetector(action="raise")
    fit(LM(d=256, layers=2, heads=4), [compiler, detector], 12, root, precision="bf16-mixed")
    steady = compiler.step_times_s
    c.note(f"compiles {compiler.watch.compiles}, breaks {compiler.watch.graph_breaks()}, steady step"
           f" {1e3 * statistics.median(steady) if steady else float('nan'):.2f} ms (CUDA events)")
    c.expect(compiler.error is None and compiler.watch.compiles >= 1 and not detector.events,
             f"compiled, no fallback ({compiler.error}), no event")


class Hungry(LM):
    """The LM, asking the GPU for a petabyte at step 4: a real CUDA out-of-memory error."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 4:
            torch.empty(2**50, dtype=torch.uint8, device=self.device)
        return super().training_step(batch, batch_idx)


def check_memory(c: Check, root: str) -> None:
    """Check 10: the memory view and ActivationCheckpointing on CUDA; a snapshot on out of memory."""
    saved = {}
    for name, extra in (("none", []), ("full", [ActivationCheckpointing(modules="auto", measure=False)])):
        windows = ProfilerWindows(every_n_steps=2, warmup=0, active=1, memory_breakdown=True, export_trace=False)
        fit(LM(d=256, layers=2, heads=4), [windows, *extra], 3, os.path.join(root, name), precision="bf16-mixed")
        report = windows.memory_report
        saved[name] = report.activations if report is not None else 0
        c.note(f"{name}: activations {saved[name] / 2**20:.1f} MB, peak"
               f" {(report.peak or 0) / 2**20 if report is not None else float('nan'):.1f} MB (allocator)")
        c.expect(report is not None and report.peak is not None and report.activations > 0,
                 f"{name}: a memory view with the allocator's peak")
    c.expect(saved["full"] <= 0.6 * saved["none"], "checkpointing every block cuts saved activations by >= 40%")
    windows = ProfilerWindows(every_n_steps=2, warmup=0, active=1, memory_breakdown=True, memory_snapshot=True,
                              export_trace=False)
    with contextlib.suppress(torch.OutOfMemoryError):
        fit(Hungry(d=256, layers=2, heads=4), [windows], 6, os.path.join(root, "oom"))
    path = windows.snapshot_file
    segments = -1
    if path is not None and os.path.exists(path):
        import pickle

        with open(path, "rb") as f:
            segments = len(pickle.load(f).get("segments", []))
    c.note(f"snapshot {path} ({os.path.getsize(path) if path and os.path.exists(path) else 0} B, {segments} segments)")
    c.expect(segments > 0, "out of memory left a snapshot that loads, with the allocator's segments")


class RoutedLM(LM):
    """The LM with a narrow router (d -> 8) whose mean joins the logits: a Linear float8 cannot take."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.router = nn.Linear(self.head.in_features, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = super().forward(ids)
        return logits + self.router(self.embed(ids)).mean(-1, keepdim=True)


def check_fp8(c: Check, root: str) -> None:
    """Check 11: rules="auto" runs the wide MLP Linears in float8, not the narrow router; faster than bf16-mixed."""
    from lightning_opkit.precision.fp8 import fp8_unit_note, torchao_problem

    problem = torchao_problem()
    if problem is not None:
        c.expect(False, f"torchao importable ({problem}; or its wheel unpacked on PYTHONPATH)")
        return
    shape = dict(d=4096, layers=2, heads=32, vocab=4096, seq=1024, batch=4)
    unit = fp8_unit_note("cuda")
    c.note(f"float8 units: {unit or 'yes'} ({torch.cuda.get_device_name()})")
    runs: dict[str, SyncCount] = {}
    policies: dict[str, PrecisionPolicy] = {}
    for name in ("bf16", "fp8", "fp8 again", "bf16 again"):
        counter = SyncCount(start=4)
        callbacks: list[pl.Callback] = [counter, TorchCompile(modules=["blocks.*"], measure=False)]
        if name.startswith("fp8"):
            policies[name] = PrecisionPolicy(rules="auto", census_every_n_steps=0, trial_steps=0)
            callbacks.append(policies[name])
        fit(RoutedLM(**shape), callbacks, 14, os.path.join(root, name), precision="bf16-mixed")
        runs[name] = counter
    policy = policies["fp8"]
    summary = policy.summary_lines()
    c.note("; ".join(summary))
    if unit:
        said = [line for line in summary if "fp8: not tried by rules='auto'" in line]
        c.expect(bool(said) and not policy.fp8.converted, f"no float8 units: rules='auto' says so: {said}")
        return
    mlp = [f"blocks.{i}.mlp.{j}" for i in range(shape["layers"]) for j in (0, 2)]
    c.expect(set(mlp) <= set(policy.fp8.by_auto), f"every wide MLP Linear in float8 by measurement"
                                                     f" ({sorted(policy.fp8.by_auto)})")
    c.expect("router" not in policy.fp8.live and any("router (4096x8: float8 GEMMs need" in line for line in summary),
             "the narrow router left in bf16, named")
    median = {k: statistics.median(runs[k].ms + runs[f"{k} again"].ms) for k in ("bf16", "fp8")}
    c.note(f"median step, blocks compiled (Inductor): bf16-mixed {median['bf16']:.2f} ms, auto with fp8"
           f" {median['fp8']:.2f} ms ({median['bf16'] / median['fp8']:.3f}x)")
    c.expect(median["fp8"] < median["bf16"], "auto with fp8 faster than bf16-mixed, both compiled")


class NvtxCount:
    """Calls into ``torch.cuda.nvtx.range_push``/``range_pop`` on this thread, from ``sys.setprofile``."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.depth = self.lowest = 0
        self._codes = (torch.cuda.nvtx.range_push.__code__, torch.cuda.nvtx.range_pop.__code__)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in self._codes:
            if frame.f_code is self._codes[0]:
                self.names.append(str(frame.f_locals.get("msg")))
                self.depth += 1
            else:
                self.depth -= 1
                self.lowest = min(self.lowest, self.depth)

    def __enter__(self) -> NvtxCount:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)


def check_nvtx(c: Check, root: str) -> None:
    """Check 12: NVTX ranges per step and module forward, balanced."""
    windows = ProfilerWindows(every_n_steps=10_000, ranges="steps")
    with NvtxCount() as seen:
        fit(LM(d=128, layers=2, vocab=512, seq=64), [windows], 4, root)
    steps = [n for n in seen.names if n.startswith("opkit step ")]
    c.note(f"{len(seen.names)} NVTX ranges pushed, {len(steps)} of them steps; e.g. {seen.names[2:5]}")
    c.expect(len(steps) == 4, "one range per training step")
    c.expect(any(n.startswith("blocks.0") and n.endswith("]") for n in seen.names), "module ranges by path [class]")
    c.expect(seen.depth == 0 and seen.lowest >= 0, "every push popped, never a pop with nothing open")
    c.expect(windows.range_marks is not None and windows.range_marks.pushed == len(seen.names),
             "the callback's count is what torch.cuda.nvtx saw")


def check_autocast_table(c: Check, root: str) -> None:
    """Check 13: a table autocast expresses runs as autocast, at autocast's step time."""
    from lightning_opkit.precision.dtypes import GOVERNED
    from lightning_opkit.precision.governor import AUTOCAST_LOWERS

    table = dict.fromkeys(GOVERNED, "keep") | dict.fromkeys(AUTOCAST_LOWERS, "bf16")
    modes: list[int] = []

    class Modes(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.handle = pl_module.embed.register_forward_pre_hook(
                lambda m, a: modes.append(len(torch.overrides._get_current_function_mode_stack())) and None)

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.handle.remove()

    def one(kind: str) -> float:
        timer, callbacks, precision = StepClock(), [], "bf16-mixed"
        if kind != "bf16-mixed":
            rules = table if kind == "autocast table" else None
            callbacks, precision = [PrecisionPolicy(rules=rules, census_every_n_steps=0, measure=False)], "32-true"
        if kind == "autocast table":
            callbacks.append(Modes())
        fit(LM(d=128, layers=4, vocab=512, seq=64), [timer, *callbacks], 30, root, precision=precision)
        return statistics.median(timer.intervals()[10:])

    times: dict[str, list[float]] = {"bf16-mixed": [], "autocast table": [], "built-in table": []}
    for _ in range(2):
        for kind in times:
            times[kind].append(one(kind))
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    c.note(", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()) +
           f"; autocast table / bf16-mixed {ms['autocast table'] / ms['bf16-mixed']:.3f},"
           f" built-in / bf16-mixed {ms['built-in table'] / ms['bf16-mixed']:.3f}")
    c.expect(ms["autocast table"] <= 1.05 * ms["bf16-mixed"], "the autocast table within 5% of bf16-mixed")
    c.expect(bool(modes) and max(modes[1:]) == 0, "no TorchFunctionMode active on its steps (census off)")


class StepClock(pl.Callback):
    """Wall time between consecutive training batch starts, the device synchronized."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        torch.cuda.synchronize()
        self.starts.append(time.perf_counter())

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]


CHECKS: list[tuple[str, Callable[[Check, str], None]]] = [
    ("1+2. device time and roofline, eager", lambda c, r: check_device_time(c, r, compiled=False)),
    ("1. device time, compiled (Inductor)", lambda c, r: check_device_time(c, r, compiled=True)),
    ("3. peaks", check_peaks),
    ("4. rules='auto' at d_model 1024", check_auto),
    ("5. one sync per checked step", check_one_sync),
    ("6. 16-true, large finite gradients", check_16_true),
    ("7. NaN named", check_nan_named),
    ("8. fp16 + GradScaler", check_fp16_scaler),
    ("9. cudagraphs", check_cudagraphs),
    ("10. memory", check_memory),
    ("11. fp8", check_fp8),
    ("12. NVTX ranges", check_nvtx),
    ("13. autocast table", check_autocast_table),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default=os.path.join(os.environ.get("OUT", "."), "gpu_report.md"))
    parser.add_argument("--only", default="", help="run the checks whose name contains this")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device here; these checks need a GPU and nothing was checked")
        return 1
    head = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda},"
            f" Lightning {pl.__version__}, {time.strftime('%Y-%m-%d')}")
    print(head, flush=True)
    out = [f"# GPU checks\n\n{head}\n"]
    failed = 0
    began = time.perf_counter()
    for name, run in CHECKS:
        if args.only and args.only not in name:
            continue
        check, t0 = Check(), time.perf_counter()
        with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                run(check, root)
            except Exception as err:
                check.expect(False, f"raised {type(err).__name__}: {err}".splitlines()[0][:300])
                check.lines.append("     " + traceback.format_exc().strip().splitlines()[-3][:300])
        verdict = "PASS" if not check.failures else "FAIL"
        failed += bool(check.failures)
        text = f"{verdict} {name} ({time.perf_counter() - t0:.0f} s)\n" + "\n".join(check.lines)
        print(text + "\n", flush=True)
        out.append(f"## {text}\n")
        with open(args.report, "w") as f:  # as it goes: a run cut short keeps what it checked
            f.write("\n".join(out))
    summary = f"{'ALL GPU CHECKS PASSED' if not failed else f'{failed} GPU CHECK(S) FAILED'} in" \
              f" {time.perf_counter() - began:.0f} s"
    print(summary)
    with open(args.report, "w") as f:
        f.write("\n".join(out) + f"\n{summary}\n")
    print("report:", args.report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
