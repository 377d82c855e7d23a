"""TorchCompile: optional, in-place, optionally regional torch.compile, observable and checkpoint-safe.

The callback orchestrates Trainer-free parts: argument checks and the backend (:mod:`~lightning_opkit.compile.config`),
the forward that replaces each region's (:mod:`~lightning_opkit.compile.compiled_forward`), block discovery and region
records (:mod:`~lightning_opkit.compile.regions`) and dynamo's counters (:mod:`~lightning_opkit.compile.watch`).

Logged (rank zero): ``opkit/compile/compile_time_s``, ``compiles``, ``graphs``, ``graph_breaks``, ``recompiles``
(scalars, when they change), ``eager_regions``, ``step_time_ms`` (median steady step), ``eager_fallback``; the
``config``, ``regions``, ``graph_break_reasons``, ``recompile_reasons`` and ``error`` tables (text).
"""

from __future__ import annotations

import statistics
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_opkit.compile.compiled_forward import (
    CompiledForward,
    RegionHooks,
    limit_message,
    nothing_compiled,
    shared_trials,
)
from lightning_opkit.compile.config import check_compile_args, make_backend
from lightning_opkit.compile.regions import REGION_HEADERS, Region
from lightning_opkit.compile.state_keys import loading_old_checkpoints
from lightning_opkit.compile.watch import DynamoWatch, recompile_table
from lightning_opkit.core.callback import OpkitCallback
from lightning_opkit.core.deprecations import renamed
from lightning_opkit.core.dynamo_compat import (
    backward_outside_autocast,
    compiled_code,
    guard_on_hooks,
    inductor_kernel_names,
)
from lightning_opkit.core.facts import facts_of
from lightning_opkit.core.kit import RunsModulesInDtype, offering
from lightning_opkit.core.select import find_blocks, outermost, resolve_modules
from lightning_opkit.core.text import describe_error
from lightning_opkit.core.timing import StepClock
from lightning_opkit.core.torch_compat import FUNCTION_MODES_UNDER_AOT
from lightning_opkit.core.warn import warn_once

__all__ = ["TorchCompile"]


class TorchCompile(OpkitCallback):
    """Compile the model (or each submodule matching a glob) in place with ``torch.compile``, and report on it.

    Compilation is in place: each target's ``forward`` is replaced by its compiled version, so the module object, its
    ``state_dict`` keys and checkpoints are those of the uncompiled model (no ``_orig_mod.``): a checkpoint saved while
    compiled loads into a plain model and vice versa, and a checkpoint with ``_orig_mod.`` keys (written by
    ``torch.compile``'s wrapper) loads too. With ``modules``, each matching submodule is compiled on its own (regional
    compilation): identical blocks share one compiled code object and compile once. Each region's compile time,
    graphs, breaks and recompiles are reported, and a region close to dynamo's recompile limit is warned about.

    Args:
        modules: globs over ``named_modules()`` names of submodules to compile; ``"auto"`` finds the repeated blocks
            (children of ``ModuleList`` / ``Sequential`` containers that share one class, the outermost such sets);
            ``None`` compiles the LightningModule's ``forward`` (what ``self(x)`` in ``training_step`` calls).
        backend: a ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, ``"eager"``, ...).
        mode: an Inductor mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``, ...); not with ``options``.
        fullgraph: fail on any graph break instead of splitting the graph.
        dynamic: ``True`` / ``False`` forces dynamic / static shapes; ``None`` lets dynamo mark a dimension dynamic
            after its first change (so a smaller last batch or an evaluation batch size recompiles once, not per size).
        options: Inductor options such as ``{"triton.cudagraphs": True}``; keys are checked against Inductor's.
        fallback: when compilation fails, warn once, log the error, and go on eagerly; ``False`` raises.
        on_recompile_limit: when a region's code reaches half of dynamo's ``recompile_limit`` cache entries (past it,
            dynamo silently runs it eagerly): ``"warn"`` names the guard that keeps failing; ``"eager"`` warns, then
            runs that region with ``torch.compiler.set_stance("eager_on_recompile")`` (its compiled code is reused,
            nothing new is compiled); ``"raise"`` raises a ``RuntimeError``.
        measure: measure before deciding: once per region, after it has compiled, time it compiled against eager on its
            own next training calls (two warm-up calls, then three of each, alternating; no extra call, on the device's
            clock) and report eager / compiled time; the price is three of each region's calls run eagerly once.
            Identical regions (the same compiled code and parameter shapes: repeated blocks) pool their calls into one
            trial and take one verdict. ``False`` times nothing, and every region stays compiled. (Was
            ``measure_speedup``, which was off by default while ``eager_if_slower`` timed anyway.)
        eager_if_slower: with ``measure``, where eager measured at least 5% faster than compiled, run that region
            eagerly from then on (its compiled code kept, unused); named in the regions table,
            ``opkit/compile/eager_regions`` and the roofline's levers. On by default: compiling is meant to speed
            training up, and fusion is not always a win (small or launch-bound regions, a region whose graph breaks).
            Under DDP and FSDP2 every rank takes rank zero's figure, so all run a region alike. ``False`` keeps every
            region compiled, its speedup still reported.
        enabled: attach the callback; ``False`` (or its area, ``compile``, in the environment variable
            ``OPKIT_DISABLE``) leaves it attaching nothing, said once at setup.
        log_dir: where to write opkit's TensorBoard files when the Trainer has no TensorBoard logger (by default none
            then: ``logger=False`` writes no file).
        measure_speedup: the old name of ``measure``; it works for this release and warns
            (:class:`~lightning_opkit.core.deprecations.OpkitDeprecationWarning`).

    Example:
        >>> compiler = TorchCompile(modules=["model.blocks.*"], backend="aot_eager")
        >>> trainer = pl.Trainer(callbacks=[compiler], logger=False)
        >>> compiler.backend
        'aot_eager'
    """

    area = "compile"

    def __init__(
        self,
        modules: Optional[Union[list[str], Literal["auto"]]] = None,
        backend: str = "inductor",
        mode: Optional[str] = None,
        fullgraph: bool = False,
        dynamic: Optional[bool] = None,
        options: Optional[dict[str, Any]] = None,
        fallback: bool = True,
        on_recompile_limit: Literal["warn", "eager", "raise"] = "warn",
        measure: bool = True,
        eager_if_slower: bool = True,
        enabled: bool = True,
        log_dir: Optional[str] = None,
        measure_speedup: Optional[bool] = None,
    ) -> None:
        super().__init__(enabled, log_dir)
        asked = measure
        measure = renamed(type(self).__name__, "measure_speedup", measure_speedup, "measure", measure, True)
        if measure_speedup is False and asked:  # the old flag was off by default, yet eager_if_slower timed each region
            measure = eager_if_slower
        check_compile_args(modules, backend, mode, options, dynamic, on_recompile_limit, fullgraph=fullgraph,
                           fallback=fallback, measure=measure, eager_if_slower=eager_if_slower)
        self.modules: list[str] | str | None = modules if modules in (None, "auto") else list(modules)
        self.backend = backend
        self.mode = mode
        self.fullgraph = fullgraph
        self.dynamic = dynamic
        self.options = dict(options) if options is not None else None
        self.fallback = fallback
        self.on_recompile_limit = on_recompile_limit
        self.measure = measure
        self.eager_if_slower = eager_if_slower

        #: module paths compiled in this run ("" = the LightningModule)
        self.compiled: list[str] = []
        #: per compiled region: calls, compiles, compile time, graphs, breaks, recompiles, speedup
        self.regions: dict[str, Region] = {}
        #: the compile error, when training fell back to eager
        self.error: str | None = None
        self._clock = StepClock()  # steady steps, on the device's clock
        self._logged_at = 0
        self.watch = DynamoWatch()
        self._compiles_at_start = 0
        self._reported: tuple[int, int, int] = (-1, -1, -1)
        self._reported_regions: tuple[Any, ...] = ()
        self._batches = 0
        self._checked_frames = False
        self._configs: list[Any] = []  # dynamo / Inductor config patches entered for the fit
        self._limit_hit: set[Any] = set()

    @property
    def measuring_steps(self) -> bool:
        """Whether a region is being timed eager against compiled (the kit runs one timed trial at a time).

        From its first timed call: a region only ever called without grad (a frozen part) never begins, and holds
        no other trial back.
        """
        return self.measure and not self.error and any(r.timing and r.speedup is None for r in self.regions.values())

    @property
    def step_times_s(self) -> list[float]:
        """Steady steps' times (no compile in them), in seconds, on the device's clock (CUDA events on a GPU)."""
        return self._clock.seconds()

    # lifecycle

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._patches:
            return  # validate/test inside fit reuse the compiled model
        if self.backend != "eager" and not FUNCTION_MODES_UNDER_AOT and any(offering(trainer, RunsModulesInDtype)):
            raise ValueError(f"TorchCompile(backend={self.backend!r}) with a PrecisionPolicy needs torch 2.11 or newer:"
                             f" on torch {torch.__version__} AOT autograd traces the policy's casts into a wrong"
                             " backward. Use backend='eager' (the policy's dtypes, traced by dynamo), or newer torch.")
        targets = self._targets(pl_module)
        self.regions, self._limit_hit = {}, set()
        backend = make_backend(self.backend, self.mode, self.options, self.dynamic)
        hooks = RegionHooks(on_failure=(lambda err: self._fall_back(trainer, err)) if self.fallback else None,
                            on_recompile=self._check_recompile_limit,
                            on_slower=lambda region: self._run_eager(trainer, region),
                            speedup=self.measure, eager_if_slower=self.measure and self.eager_if_slower,
                            sizes_dynamic=self.dynamic is not False,
                            agree=lambda value: trainer.strategy.broadcast(value, src=0))
        built = []
        for name, module in targets:
            # ``forward`` itself, not ``_call_impl``: dynamo converts no frame of a compiled ``_call_impl`` (nor of
            # ``nn.Module.compile()``) for torch.nn's own modules, whose code it skips; a compiled ``forward`` is
            # traced for every module. The module's own hooks then run eagerly around the compiled region.
            original = module.forward
            compiled = torch.compile(original, backend=backend, fullgraph=self.fullgraph, dynamic=self.dynamic)
            built.append((module, Region(name, code=compiled_code(compiled)), original, compiled))
        shared = shared_trials([(region, module) for module, region, _, _ in built])
        for (module, region, original, compiled), trial in zip(built, shared, strict=True):
            self.regions[region.name] = region
            self._patches.set(module, "forward", CompiledForward(module, region, original, compiled, self.watch, hooks,
                                                                 trial))
        self._patches.set(pl_module, "on_load_checkpoint", loading_old_checkpoints(pl_module.on_load_checkpoint))
        self.compiled = [name for name, _ in targets]
        self._batches, self._checked_frames, self.error = 0, False, None
        self._configs = [
            guard_on_hooks(),  # opkit's and the user's hooks count: compiled code is not reused past a hook change
            inductor_kernel_names(),  # Inductor's CPU kernels by name in profiler windows, classified by their ops
            # A region's backward in the dtypes its forward saved, as eager's: not under the forward's autocast
            backward_outside_autocast(),
        ]
        for config in self._configs:
            config.__enter__()
        self.watch.open()
        writer = self._open_writer(trainer, "fit")
        settings = dict(backend=self.backend, mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic,
                        options=self.options)
        writer.table("opkit/compile/config", ["setting", "value"],
                     [["compiled", ", ".join(n or "<LightningModule>" for n in self.compiled)],
                      *[[k, v] for k, v in settings.items()]], trainer.global_step)

    def _targets(self, pl_module: pl.LightningModule) -> list[tuple[str, torch.nn.Module]]:
        if self.modules is None:
            return [("", pl_module)]
        if self.modules == "auto":
            names = find_blocks(pl_module)
            if not names:
                raise ValueError(
                    f"TorchCompile(modules='auto') found no repeated blocks in {type(pl_module).__name__} (children"
                    " of a ModuleList/Sequential that share one class). Name the modules to compile as globs, or"
                    " use modules=None for the whole forward.")
            rank_zero_info(f"TorchCompile(modules='auto') compiles {len(names)} blocks: {', '.join(names)}")
            return [(name, pl_module.get_submodule(name)) for name in names]
        return outermost(resolve_modules(pl_module, self.modules, owner="TorchCompile"))

    def _check_recompile_limit(self, region: Region) -> None:
        if region.code in self._limit_hit:
            return
        found = limit_message(region, self.regions)
        if found is None:
            return
        self._limit_hit.add(region.code)
        text, sharing = found
        if self.on_recompile_limit == "raise":
            raise RuntimeError(text + " (on_recompile_limit='raise')")
        if self.on_recompile_limit == "eager":
            for name in sharing:
                self.regions[name].eager = True
            text += (" These regions now run with set_stance('eager_on_recompile'): compiled code is reused, nothing"
                     " new is compiled.")
        else:
            text += " Mark the changing dimension dynamic, raise the limit, or set on_recompile_limit='eager'."
        warn_once(text, stacklevel=3)

    def _run_eager(self, trainer: pl.Trainer, region: Region) -> None:
        facts_of(trainer).eager_regions[region.name] = region.speedup or 0.0
        rank_zero_info(f"TorchCompile: region {region.name or '<LightningModule>'!r} measured slower compiled than"
                       f" eager (eager/compiled time {region.speedup:.2f}x): it runs eagerly from now on"
                       " (eager_if_slower=True).")

    def _fall_back(self, trainer: pl.Trainer, err: BaseException) -> None:
        self.error = describe_error(err, limit=None)
        self._patches.restore()  # every compiled region goes back to eager, once
        warn_once(f"TorchCompile: compilation failed, training continues eagerly. {self.error}", stacklevel=4)
        if self._writer is not None:
            self._writer.scalar("opkit/compile/eager_fallback", 1, trainer.global_step)
            self._writer.text("opkit/compile/error", f"Compilation failed; training continues eagerly.\n\n"
                                                     f"```\n{err}\n```", trainer.global_step)
            self._writer.flush()

    def layout(self) -> dict[str, dict[str, list[Any]]]:
        """Compiles, graphs, breaks and recompiles; compile time; the steady step time."""
        return {"opkit compile": {
            "compiles, graphs, breaks, recompiles": ["Multiline", [r"opkit/compile/compiles", r"opkit/compile/graphs",
                                                                   r"opkit/compile/graph_breaks",
                                                                   r"opkit/compile/recompiles"]],
            "compile time (s)": ["Multiline", [r"opkit/compile/compile_time_s"]],
            "step time (ms)": ["Multiline", [r"opkit/compile/step_time_ms"]],
        }}

    def summary_lines(self) -> list[str]:
        """This callback's lines of the run summary."""
        watch = self.watch
        regions = ", ".join(n or "<LightningModule>" for n in self.compiled[:4]) + (
            f" (+{len(self.compiled) - 4} more)" if len(self.compiled) > 4 else "")
        line = (f"compile ({self.backend}): {watch.compile_time_s:.1f} s compiling, {watch.graphs} graph(s),"
                f" {sum(watch.graph_breaks().values())} graph break(s), {len(watch.recompile_reasons)} recompile(s);"
                f" regions: {regions or '-'}")
        expected = sum(r.expected_recompiles for r in self.regions.values())
        if expected:
            line += f" ({expected} of the recompiles expected: grad modes, the policy's table, a size marked dynamic)"
        lines = [line]
        slower = {n: r.speedup for n, r in self.regions.items() if r.slower}
        if slower:
            lines.append("  measured slower compiled than eager (eager/compiled time), running eagerly: " + ", ".join(
                f"{n or '<LightningModule>'} {s:.2f}x" for n, s in list(slower.items())[:4])
                + (f" (+{len(slower) - 4} more)" if len(slower) > 4 else ""))
        if self.error is not None:
            lines.append(f"  fell back to eager: {self.error[:200]}")
        return lines

    @override
    def _release(self, trainer: pl.Trainer | None, pl_module: pl.LightningModule | None) -> None:
        if self._writer is not None and trainer is not None:
            self._log(trainer, final=True)
        self.watch.close()
        while self._configs:
            self._configs.pop().__exit__(None, None, None)

    # observability

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after every callback's setup, when the run's facts are the fit's: the roofline reads what is compiled
        facts_of(trainer).compiled = list(self.compiled)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._compiles_at_start = self.watch.compiles
        self._clock.start(pl_module.device)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # steady state only: nothing compiled in this step
        self._clock.stop(keep=self.watch.compiles == self._compiles_at_start and self.error is None)
        self._batches += 1
        if self._batches >= 2:
            self._check_frames()
        self._log(trainer, final=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._batches:
            self._check_frames()

    def _check_frames(self) -> None:
        if self._checked_frames:
            return
        self._checked_frames = True
        warning = None if self.error is not None else nothing_compiled(
            self.watch, self.regions, self.compiled, self.modules is None, self._batches)
        if warning is not None:
            warn_once(warning, stacklevel=2)

    # what gets logged where

    def _log(self, trainer: pl.Trainer, final: bool) -> None:
        writer = self._writer
        if writer is None or not writer.active:
            return
        step = trainer.global_step
        self._log_counts(step)
        regions = tuple((r.compiles, r.recompiles, r.speedup, r.runs) for r in self.regions.values())
        if regions != self._reported_regions or final:
            self._reported_regions = regions
            writer.table("opkit/compile/regions", REGION_HEADERS, [r.row() for r in self.regions.values()], step)
            writer.scalar("opkit/compile/eager_regions", sum(r.runs != "compiled" for r in self.regions.values()), step)
        steady = self._clock.seconds(wait=final)
        every = max(1, int(getattr(trainer, "log_every_n_steps", 50)))  # set by Lightning at init, not declared
        # on CUDA a step's time arrives once its events completed: logged when the count passes a multiple
        if steady and (final or len(steady) // every > self._logged_at // every):
            self._logged_at = len(steady)
            writer.scalar("opkit/compile/step_time_ms", 1e3 * statistics.median(steady[-100:]), step)
        if final:
            writer.flush()

    def _log_counts(self, step: int) -> None:
        writer, watch = self._writer, self.watch
        assert writer is not None
        breaks = watch.graph_breaks()
        state = (watch.compiles, sum(breaks.values()), len(watch.recompile_reasons))
        if state == self._reported:
            return
        self._reported = state
        writer.scalars("opkit/compile", {"compile_time_s": watch.compile_time_s, "compiles": watch.compiles,
                                         "graphs": watch.graphs, "graph_breaks": sum(breaks.values()),
                                         "recompiles": len(watch.recompile_reasons)}, step)
        if breaks:
            writer.table("opkit/compile/graph_break_reasons", ["reason", "count"],
                         sorted(breaks.items(), key=lambda kv: -kv[1]), step)
        if watch.recompile_reasons:
            writer.table("opkit/compile/recompile_reasons", ["function", "guard that failed", "count"],
                         recompile_table(watch.recompile_reasons), step)
