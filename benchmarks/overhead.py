"""Interleaved A/B overhead runs of opkit callbacks on the example ViT; prints medians and ratios.

Every variant trains the same model for ``--steps`` steps per repetition; variants alternate (A B A B ...) within
one process so drift hits all of them alike. Step time is the wall time between consecutive batch starts (so every
hook's cost is inside it), median over the steps after ``--skip`` warm-up steps, then median over repetitions.

    python benchmarks/overhead.py --suite all
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from examples.vit import ViTClassifier, load_digits_tensors  # noqa: E402
from lightning_opkit import NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile  # noqa: E402

ACCELERATOR = "cpu"


class StepTimer(pl.Callback):
    """Wall time between consecutive training batch starts."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        self.starts.append(time.perf_counter())

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]


class HookClock:
    """Time spent inside a callback's Lightning hooks: the callback's own cost, free of run-to-run noise."""

    def __init__(self, callback: pl.Callback) -> None:
        self.seconds = 0.0
        #: seconds inside the hooks per global step (the step the Trainer was at when the hook ran)
        self.per_step: dict[int, float] = {}
        #: of those, the hooks the callback leaves to Lightning's base class (no-ops Lightning calls all the same: their
        #: time is the call itself and this clock's own reads, in whatever state the step left the caches)
        self.inherited_per_step: dict[int, float] = {}
        for name in dir(type(callback)):
            if name.startswith("on_") and name != "on_exception" and callable(getattr(callback, name)):
                inherited = getattr(type(callback), name) is getattr(pl.Callback, name, None)
                setattr(callback, name, self._timed(getattr(callback, name), inherited))

    def _timed(self, hook, inherited: bool):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                self.seconds += spent
                step = getattr(args[0], "global_step", None) if args else None
                if step is not None:
                    self.per_step[step] = self.per_step.get(step, 0.0) + spent
                    if inherited:
                        self.inherited_per_step[step] = self.inherited_per_step.get(step, 0.0) + spent

        return timed


def hook_cost(make_callback: Callable[[], pl.Callback], steps: int, skip: int) -> tuple[float, float]:
    """``(ms inside the callback's hooks per step, median step ms)`` over one run."""
    callback = make_callback()
    clock = HookClock(callback)
    step, _ = run(lambda: (vit(), [callback], {}), steps, skip)
    return 1e3 * clock.seconds / steps, 1e3 * step


def loader(batch_size: int = 64) -> DataLoader:
    images, labels = load_digits_tensors()
    return DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(0))


Variant = Callable[[], tuple[pl.LightningModule, list[pl.Callback], dict]]


def run(make: Variant, steps: int, skip: int, timer: StepTimer | None = None) -> tuple[float, list[pl.Callback]]:
    model, callbacks, kwargs = make()
    data = kwargs.pop("data", None) or loader()  # a zoo model brings its own
    timer = timer or StepTimer()
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(default_root_dir=root, max_steps=steps, accelerator=ACCELERATOR, devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[timer, *callbacks], limit_val_batches=0, num_sanity_val_steps=0,
                             **{"precision": "32-true", **kwargs})
        trainer.fit(model, data)
    return statistics.median(timer.intervals()[skip:]), callbacks


def interleave(variants: dict[str, Variant], steps: int, reps: int, skip: int) -> dict[str, float]:
    # The first variant runs twice per repetition: its A/A ratio shows the noise floor of the figures.
    first = next(iter(variants))
    variants = {**variants, f"{first} (A/A control)": variants[first]}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, make in variants.items():
            times[name].append(run(make, steps, skip)[0])
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(title: str, medians: dict[str, float], base: str) -> None:
    print(f"\n== {title}")
    for name, t in medians.items():
        print(f"  {name:<34} {1e3 * t:8.2f} ms/step   ratio vs {base}: {t / medians[base]:.3f}")


def vit(**kw) -> ViTClassifier:
    torch.manual_seed(0)
    return ViTClassifier(**kw)


def suite_nan(args) -> None:
    medians = interleave({
        "no callback": lambda: (vit(), [], {}),
        "NaNDetector (every step)": lambda: (vit(), [NaNDetector()], {}),
        "NaNDetector (repair=False)": lambda: (vit(), [NaNDetector(repair=False)], {}),
        "NaNDetector (spike_zscore=6)": lambda: (vit(), [NaNDetector(spike_zscore=6.0)], {}),
        "detect_anomaly=True": lambda: (vit(), [], {"detect_anomaly": True}),
    }, args.steps, args.reps, args.skip)
    report("NaNDetector overhead (forward+backward+loss checks every step)", medians, "no callback")
    print(f"  repair on / off (nothing runs for it on a healthy step): "
          f"{medians['NaNDetector (every step)'] / medians['NaNDetector (repair=False)']:.3f}")
    print(f"  spikes on / off (the same one sync; a few reductions on the device): "
          f"{medians['NaNDetector (spike_zscore=6)'] / medians['NaNDetector (every step)']:.3f}")
    print(f"  NaNDetector / detect_anomaly: {medians['NaNDetector (every step)'] / medians['detect_anomaly=True']:.3f}")
    for label, kwargs in (("", {}), (" with spike_zscore=6", {"spike_zscore": 6.0})):
        inside, step = hook_cost(functools.partial(NaNDetector, **kwargs), args.steps, args.skip)
        print(f"  time inside NaNDetector's hooks{label}: {inside:.3f} ms/step"
              f" = {100 * inside / step:.2f}% of a {step:.2f} ms step")


def suite_nan_check(args) -> None:
    """The per-step check with norms against the one without (finite only), across gradient counts and sizes.

    Interleaved in one process: each round times both on the same tensors, the ratio is per round, its median printed.
    Past ``FINITE_ONLY_ELEMENTS`` the check without norms hands over to the one with them (ratio ~1); the raw passes are
    timed there too, to show why.
    """
    from lightning_opkit.core.torch_compat import foreach_non_finite_check_, foreach_norm
    from lightning_opkit.nan.check import FINITE_ONLY_ELEMENTS, check

    cpu, threads = torch.device("cpu"), torch.get_num_threads()
    for count, size, n in [(c, s, n) for n in sorted({1, threads}) for c, s in (
            (28, 1_000), (150, 20_000), (200, 20_000), (50, 160_000), (100, 160_000), (64, 500_000))]:
        if (count, size) == (28, 1_000):
            print(f"\n== NaNDetector's check on CPU, {n} thread(s): norms (spike_zscore set) against finite only (the"
                  f" default); finite only up to {FINITE_ONLY_ELEMENTS:,} elements")
        torch.set_num_threads(n)
        grads, losses = [torch.randn(size) for _ in range(count)], [torch.tensor(1.0)]
        timed = {"norms": functools.partial(check, losses, grads, cpu),
                 "finite only": functools.partial(check, losses, grads, cpu, norms=False),
                 "raw norm pass": functools.partial(foreach_norm, grads, 2, dtype=torch.float32),
                 "raw in-place pass": functools.partial(foreach_non_finite_check_, grads, torch.zeros(1),
                                                        torch.ones(()))}
        calls = max(3, int(2e7 // (count * size)))
        ratios: dict[str, list[float]] = {"check": [], "raw": []}
        for _ in range(max(args.reps, 5)):
            seconds = {}
            for name, fn in timed.items():
                fn()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                seconds[name] = (time.perf_counter() - t0) / calls
            ratios["check"].append(seconds["finite only"] / seconds["norms"])
            ratios["raw"].append(seconds["raw in-place pass"] / seconds["raw norm pass"])
        print(f"  {count:4d} x {size:>9,} ({count * size:>11,} elements): finite only / norms"
              f" {statistics.median(ratios['check']):.2f}   (raw passes: in-place / norm"
              f" {statistics.median(ratios['raw']):.2f})")
    torch.set_num_threads(threads)


class FusedViT(ViTClassifier):
    """The example ViT under a fused AdamW (no schedule): what ``NaNDetector(decide="device")`` needs."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.05, fused=True)


def fused_vit() -> FusedViT:
    torch.manual_seed(0)
    return FusedViT()


def suite_nan_device(args) -> None:
    medians = interleave({
        "no callback (fused AdamW)": lambda: (fused_vit(), [], {}),
        "NaNDetector decide='host'": lambda: (fused_vit(), [NaNDetector()], {}),
        "NaNDetector decide='device'": lambda: (fused_vit(), [NaNDetector(decide="device")], {}),
    }, args.steps, args.reps, args.skip)
    report("NaNDetector: the flags read before the step, or left to the fused optimizer on the device", medians,
           "no callback (fused AdamW)")
    host, device = medians["NaNDetector decide='host'"], medians["NaNDetector decide='device'"]
    print(f"  decide device / host: {device / host:.3f}")


def suite_precision(args) -> None:
    medians = interleave({
        "bf16-mixed": lambda: (vit(), [], {"precision": "bf16-mixed"}),
        "bf16-mixed + PrecisionPolicy": lambda: (vit(), [PrecisionPolicy(census_every_n_steps=0, measure=False)],
                                                 {"precision": "bf16-mixed"}),
    }, args.steps, args.reps, args.skip)
    report("PrecisionPolicy (built-in table) over plain bf16-mixed, eager", medians, "bf16-mixed")


def suite_precision_loop(args) -> None:
    """The policy's own cost without Lightning around it: forward+backward loops, eager and regional-compiled."""
    import torch.nn.functional as F

    from examples.vit import TinyViT

    images, labels = load_digits_tensors()
    x, y = images[:64], labels[:64]
    for compiled in (False, True):
        torch.manual_seed(0)
        net = TinyViT()
        if compiled:
            for block in net.blocks:
                block.compile()
        policy = PrecisionPolicy(census_every_n_steps=0)
        policy._governor.state.autocast_devices = ["cpu"]

        def step(governed: bool, net=net, policy=policy) -> float:
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if governed:
                    with policy._governor.mode:
                        loss = F.cross_entropy(net(x), y)
                else:
                    loss = F.cross_entropy(net(x), y)
            loss.backward()
            return time.perf_counter() - t0

        for governed in (False, True, False, True):
            step(governed)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(10 * args.reps):
            for governed in (False, True):
                times[governed].append(step(governed))
        plain, governed = statistics.median(times[False]), statistics.median(times[True])
        label = "regional inductor" if compiled else "eager"
        print(f"\n== PrecisionPolicy mode in a bare training loop ({label}), vs bf16 autocast alone")
        print(f"  autocast {1e3 * plain:.2f} ms, + policy {1e3 * governed:.2f} ms, ratio {governed / plain:.3f}")


def suite_precision_auto(args) -> None:
    """rules="auto" against the faster of plain fp32 and plain bf16-mixed on this machine, and what measuring costs."""
    policies: list[PrecisionPolicy] = []

    def auto():
        policies.append(PrecisionPolicy(rules="auto", census_every_n_steps=0))
        return vit(), [policies[-1]], {}

    medians = interleave({
        "fp32 (32-true)": lambda: (vit(), [], {}),
        "bf16-mixed": lambda: (vit(), [], {"precision": "bf16-mixed"}),
        "PrecisionPolicy(rules='auto')": auto,
    }, args.steps, args.reps, args.skip)
    report("PrecisionPolicy(rules='auto') vs plain fp32 and plain bf16-mixed", medians, "fp32 (32-true)")
    best = min(("fp32 (32-true)", "bf16-mixed"), key=medians.__getitem__)
    ratio = medians["PrecisionPolicy(rules='auto')"] / medians[best]
    print(f"  auto / faster of fp32 and bf16-mixed ({best}): {ratio:.3f} (target <= 1.05)")
    seconds = [p.measurements.seconds for p in policies if p.measurements is not None]
    print(f"  measurement at fit start: median {statistics.median(seconds):.2f} s (first, cold {seconds[0]:.2f} s)")
    last = policies[-1]
    print(f"  decided on {last.measurements.device}: " + ", ".join(
        f"{c} {d.dtype}" for c, d in last.decisions.items()))
    print("\n" + last.measurements.table({c: d.dtype for c, d in last.decisions.items()}))


def suite_precision_compile(args) -> None:
    def compiled(policy: bool):
        callbacks = [PrecisionPolicy(census_every_n_steps=0, measure=False)] if policy else []
        return vit(), [*callbacks, TorchCompile(modules=["model.blocks.*"])], {"precision": "bf16-mixed"}

    medians = interleave({
        "bf16-mixed + TorchCompile": lambda: compiled(False),
        "bf16-mixed + TorchCompile + PrecisionPolicy": lambda: compiled(True),
    }, args.steps, args.reps, args.skip + 5)
    report("PrecisionPolicy under compile (regional inductor), over compile alone", medians,
           "bf16-mixed + TorchCompile")


def suite_ranges(args) -> None:
    """ProfilerWindows(ranges="steps"): an ITT range per module forward and step, on every step (no window open)."""
    medians = interleave({
        "no callback": lambda: (vit(), [], {}),
        'ProfilerWindows(ranges="steps")': lambda: (vit(), [ProfilerWindows(every_n_steps=10_000, ranges="steps")],
                                                    {}),
    }, args.steps, args.reps, args.skip)
    report("Named ranges (ITT on a CPU) on every step, the example ViT", medians, "no callback")
    inside, step = hook_cost(lambda: ProfilerWindows(every_n_steps=10_000, ranges="steps"), args.steps, args.skip)
    print(f"  time inside ProfilerWindows' hooks (the step ranges): {inside:.3f} ms/step = {100 * inside / step:.2f}%"
          f" of a {step:.2f} ms step; the module ranges' hooks run inside the forward, in the ratio above")
    # the module ranges, free of run-to-run noise: the same forward + backward with and without them, alternating
    from lightning_opkit.profiler.ranges import Ranges, range_functions

    model, (images, labels) = vit(), load_digits_tensors()
    x, y = images[:64], labels[:64]
    ranges = Ranges(*range_functions("cpu"))
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(40 * args.reps):
        marked = rep % 2 == 1
        if marked:
            ranges.attach(model)
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        times[marked].append(time.perf_counter() - t0)
        ranges.detach()
    plain, marked = statistics.median(times[False][2:]), statistics.median(times[True][2:])
    per_forward = ranges.pushed / (len(times[True]))
    print(f"  forward + backward, bare loop: {1e3 * plain:.2f} ms, with the module ranges {1e3 * marked:.2f} ms"
          f" (ratio {marked / plain:.3f}; {per_forward:.0f} ranges a forward)")


def suite_profiler(args) -> None:
    medians = interleave({
        "no callback": lambda: (vit(), [], {}),
        "ProfilerWindows (idle between windows)": lambda: (vit(), [ProfilerWindows(every_n_steps=10_000)], {}),
        "ProfilerWindows(memory_breakdown=True) (idle)": lambda: (
            vit(), [ProfilerWindows(every_n_steps=10_000, memory_breakdown=True)], {}),
    }, args.steps, args.reps, args.skip)
    report("ProfilerWindows idle cost", medians, "no callback")
    for label, memory in (("", False), (" with memory_breakdown=True", True)):
        inside, step = hook_cost(lambda memory=memory: ProfilerWindows(every_n_steps=10_000, memory_breakdown=memory),
                                 args.steps, args.skip)
        print(f"  time inside ProfilerWindows' hooks between windows{label}: {inside:.3f} ms/step"
              f" = {100 * inside / step:.2f}% of a {step:.2f} ms step")
    timer_runs = []
    for _ in range(args.reps):
        cb = ProfilerWindows(every_n_steps=10, warmup=1, active=3)
        t, _ = run(lambda cb=cb: (vit(), [cb], {}), 40, args.skip)
        timer_runs.append((t, cb.last_report.step_time_ms / 1e3 if cb.last_report else float("nan")))
    idle = statistics.median(t for t, _ in timer_runs)
    inside = statistics.median(w for _, w in timer_runs)
    print(f"  step inside a window: {1e3 * inside:.2f} ms vs {1e3 * idle:.2f} ms outside (ratio {inside / idle:.3f})")
    prof_cb = ProfilerWindows(every_n_steps=10, warmup=1, active=3)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(default_root_dir=root, max_steps=14, logger=pl.loggers.TensorBoardLogger(root),
                             enable_progress_bar=False, enable_checkpointing=False, callbacks=[prof_cb])
        t0 = time.perf_counter()
        trainer.fit(vit(), loader())
        del t0
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(trainer.logger.log_dir)
        acc.Reload()
        export = acc.Scalars("opkit/profiler/export_s")[0].value
        size = os.path.getsize(prof_cb.trace_files[0])
    print(f"  trace export: {export:.3f} s for a 3-step window ({size / 1024:.0f} KiB gzipped)")


def suite_compile(args) -> None:
    import torch._dynamo

    def manual():
        # What users write by hand (and what renames every checkpoint key to ``model._orig_mod.*``).
        module = vit()
        module.model = torch.compile(module.model)
        return module, [], {}

    ours = 'TorchCompile(modules=["model"])'
    medians = interleave({
        "manual torch.compile(model.model)": manual,
        ours: lambda: (vit(), [TorchCompile(modules=["model"])], {}),
    }, args.steps, args.reps, args.skip + 5)
    report("TorchCompile steady state vs manual torch.compile of the same module (inductor, CPU)", medians,
           "manual torch.compile(model.model)")
    base = medians["manual torch.compile(model.model)"]
    print(f"  throughput TorchCompile / manual: {base / medians[ours]:.3f}")


def gpt2_depth8():
    """The zoo's tiny GPT-2 (tests/zoo), 8 blocks deep, on random tokens."""
    import dataclasses

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from transformers import GPT2Config, GPT2LMHeadModel
    from zoo import CASES, ZooModule

    case = dataclasses.replace(CASES["hf_gpt2"], build=lambda: GPT2LMHeadModel(GPT2Config(
        n_embd=64, n_layer=8, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
        use_cache=False)))
    torch.manual_seed(0)
    module = ZooModule(case)
    return module, module.loader(n=64)


def cold_start_one(model: str, regional: bool) -> tuple[float, float]:
    """One cold compile in this (fresh) process: dynamo-measured compile time and first-step wall time."""
    cb = TorchCompile(modules="auto" if regional else None)
    timer = StepTimer()
    if model == "gpt2":
        module, loader = gpt2_depth8()
        trainer = pl.Trainer(max_steps=3, accelerator=ACCELERATOR, devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, timer],
                             default_root_dir=tempfile.mkdtemp())
        trainer.fit(module, loader)
    else:
        run(lambda: (vit(depth=8), [cb, timer], {}), 3, 0)
    return cb.watch.compile_time_s, timer.intervals()[0]


def suite_cold_start(args) -> None:
    import json
    import subprocess

    # Each compile runs in a fresh process with an empty Inductor cache directory: no in-memory or on-disk kernel
    # cache can carry over from one variant to the other.
    for model, title in (("vit", "example ViT, 8 blocks"), ("gpt2", "zoo GPT-2, 8 blocks")):
        cold: dict[str, list[tuple[float, float]]] = {"whole": [], "regional": []}
        for _ in range(args.reps):
            for name in cold:
                with tempfile.TemporaryDirectory() as cache:
                    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
                    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--cold-one", f"{model}:{name}"],
                                         env=env, capture_output=True, text=True, check=True).stdout
                cold[name].append(tuple(json.loads(out.strip().splitlines()[-1])))
        (whole_c, whole_s), (reg_c, reg_s) = ((statistics.median(c for c, _ in v),
                                               statistics.median(s for _, s in v)) for v in cold.values())
        print(f"\n== Cold start, {title}, inductor: modules=None vs modules='auto' (fresh process, empty cache)")
        print(f"  compile time (dynamo callbacks): whole {whole_c:.2f} s, regional {reg_c:.2f} s"
              f" (ratio {reg_c / whole_c:.3f})")
        print(f"  first training step:             whole {whole_s:.2f} s, regional {reg_s:.2f} s"
              f" (ratio {reg_s / whole_s:.3f})")


KIT_EVERY = 20  # census and profiler windows every 20 steps: steps 20-22, 40-42, ... are census or window steps


def kit(census: bool = True) -> list[pl.Callback]:
    """All five callbacks, as a user adds them: auto precision, every step checked, windows, compile, checkpointing."""
    from lightning_opkit import ActivationCheckpointing

    return [PrecisionPolicy(rules="auto", census_every_n_steps=KIT_EVERY if census else 0), NaNDetector(),
            ProfilerWindows(every_n_steps=KIT_EVERY, warmup=1, active=2), TorchCompile(modules="auto", backend="eager"),
            ActivationCheckpointing()]


def zoo_variant(name: str):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from zoo import build

    def make(callbacks: list[pl.Callback]):
        model = build(name)
        return model, callbacks, {"data": model.loader(n=4 * 200)}

    return make


def wide_variant(name: str, width: int, callbacks: list[pl.Callback]):
    from launch_bound import zoo_model  # imports this module: only at call time

    model = zoo_model(name, width)
    return model, callbacks, {"data": model.loader(n=4 * 200)}


def suite_kit(args) -> None:
    """The whole kit's steady-state cost: steps between census and windows, census and window steps, per callback."""
    models = {"example ViT": lambda callbacks: (vit(), callbacks, {}),
              "hf_gpt2 (zoo)": zoo_variant("hf_gpt2"), "hf_llama (zoo)": zoo_variant("hf_llama")}
    for width in args.kit_widths:  # the same two at a wider d_model, built as benchmarks/launch_bound.py builds them
        for name in ("hf_gpt2", "hf_llama"):
            models[f"{name} d_model {width}"] = functools.partial(wide_variant, name, width)
    steps = max(args.steps, 3 * KIT_EVERY)

    def between(step: int) -> bool:  # not a census step, not in a window, past auto's measurement and trials
        return step >= 10 and step % KIT_EVERY >= 3

    for title, make in models.items():
        rows: dict[str, list[float]] = {"without": [], "with the kit": [], "census/window steps": []}
        inside: dict[str, list[float]] = {}
        inherited: list[float] = []  # all five's hooks left to Lightning's base class, per step between
        for _ in range(args.reps):
            timer = StepTimer()
            run(lambda make=make: make([]), steps, 0, timer)
            base = [t for i, t in enumerate(timer.intervals()) if between(i)]
            callbacks = kit()
            clocks = {type(c).__name__: HookClock(c) for c in callbacks}
            timer = StepTimer()
            run(lambda make=make, callbacks=callbacks: make(callbacks), steps, 0, timer)
            ticks = timer.intervals()
            rows["without"].append(statistics.median(base))
            rows["with the kit"].append(statistics.median(t for i, t in enumerate(ticks) if between(i)))
            rows["census/window steps"].append(statistics.median(
                t for i, t in enumerate(ticks) if i >= KIT_EVERY and i % KIT_EVERY < 3))
            for name, clock in clocks.items():
                inside.setdefault(name, []).append(statistics.median(
                    s for i, s in clock.per_step.items() if between(i)))
            inherited.append(statistics.median(sum(c.inherited_per_step.get(i, 0.0) for c in clocks.values())
                                               for i in range(steps) if between(i)))
        step = statistics.median(rows["with the kit"])
        print(f"\n== The kit's steady state on {title} ({args.reps} runs each; between = steps past 10 that are"
              f" neither census nor window steps)")
        for name, values in rows.items():
            print(f"  {name:<22} {1e3 * statistics.median(values):8.2f} ms/step")
        hooks = 0.0
        for name, values in inside.items():
            hooks += statistics.median(values)
            print(f"  inside {name}'s hooks on a step between: {1e3 * statistics.median(values):.3f} ms"
                  f" = {100 * statistics.median(values) / step:.2f}% of the step")
        print(f"  all five callbacks' hooks on a step between: {100 * hooks / step:.2f}% of the step (target < 2%)")
        noop = statistics.median(inherited)
        print(f"    of which Lightning calling the hooks they leave to its base class (no-ops; the call and this"
              f" clock's reads): {1e3 * noop:.3f} ms; their own code: {100 * (hooks - noop) / step:.2f}% of the step")
        alone(make, steps, args.reps, between)


def alone(make, steps: int, reps: int, between: Callable[[int], bool]) -> None:
    """Each callback alone against the same run without any, by step time on the steps between.

    Not by its hooks' clock: an observer outside the kit, which sees what the hooks leave out (a compiled region's
    dispatch, a checkpoint's recompute, caches the check leaves cold or warm). Interleaved; the run without any twice
    (A/A).
    """
    callbacks = {type(c).__name__: i for i, c in enumerate(kit())}
    variants = {"none": None, "none (A/A control)": None, **callbacks, "all five": -1}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, index in variants.items():
            chosen = [] if index is None else kit() if index == -1 else [kit()[index]]
            timer = StepTimer()
            run(lambda chosen=chosen: make(chosen), steps, 0, timer)
            times[name].append(statistics.median(t for i, t in enumerate(timer.intervals()) if between(i)))
    base = statistics.median(times["none"])
    print("  step time between, each callback alone against none (medians over runs, interleaved):")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"    {name:<26} {1e3 * median:8.2f} ms/step   ratio {median / base:.3f}")


def suite_checked_steps(args) -> None:
    """NaNDetector's cost per checked step by step time, paired in one run: an observer outside its hooks' clock.

    ``NaNDetector(every_n_steps=2)`` checks the even steps only: each checked step's time minus the unchecked step
    after it, median over the run (steps past 20), is what checking adds to a step, moved costs included (work the
    hooks do that the step would otherwise do, or leave the step to do). The same pairing with no callback and with
    every step checked is the A/A: both steps of each pair alike.
    """
    steps = max(args.steps, 400)
    for title, make in {"hf_gpt2 (zoo)": zoo_variant("hf_gpt2"), "hf_llama (zoo)": zoo_variant("hf_llama")}.items():
        variants = {"no callback (A/A)": list, "every step checked (A/A)": lambda: [NaNDetector()],
                    "every other step checked": lambda: [NaNDetector(every_n_steps=2)]}
        found: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for _ in range(args.reps):
            for name, callbacks in variants.items():
                timer = StepTimer()
                run(lambda make=make, callbacks=callbacks: make(callbacks()), steps, 0, timer)
                ticks = timer.intervals()[20:]  # step 20 is checked: pairs (20, 21), (22, 23), ...
                pairs = [a - b for a, b in zip(ticks[0::2], ticks[1::2])]
                found[name].append((statistics.median(pairs), statistics.median(ticks)))
        print(f"\n== A checked step minus the unchecked step after it, {title} ({args.reps} runs of {steps} steps)")
        for name, values in found.items():
            added, step = statistics.median(d for d, _ in values), statistics.median(t for _, t in values)
            spread = ", ".join(f"{1e6 * d:+.0f}" for d, _ in values)
            print(f"  {name:<26} {1e6 * added:+7.1f} us = {100 * added / step:+.2f}% of its {1e3 * step:.2f} ms step"
                  f"   (runs: {spread} us)")


SUITES = {"nan": suite_nan, "nan_check": suite_nan_check, "nan_device": suite_nan_device, "precision": suite_precision,
          "precision_loop": suite_precision_loop,
          "precision_auto": suite_precision_auto,
          "precision_compile": suite_precision_compile,
          "profiler": suite_profiler, "compile": suite_compile, "cold_start": suite_cold_start, "kit": suite_kit,
          "ranges": suite_ranges, "checked_steps": suite_checked_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of each median")
    parser.add_argument("--kit-widths", nargs="*", type=int, default=[],
                        help="--suite kit: also the zoo GPT-2 and Llama at these d_model (4 layers, seq 64)")
    parser.add_argument("--cold-one", help=argparse.SUPPRESS)  # "vit:whole", "gpt2:regional", ...
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    global ACCELERATOR
    ACCELERATOR = args.accelerator
    if args.cold_one:
        import json

        model, variant = args.cold_one.split(":")
        print(json.dumps(cold_start_one(model, variant == "regional")))
        return
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, lightning {pl.__version__}, {torch.get_num_threads()} threads")
    for name, suite in SUITES.items():
        if args.suite in (name, "all"):
            suite(args)


if __name__ == "__main__":
    main()
