"""TorchCompile: optional, in-place, optionally regional torch.compile, observable and checkpoint-safe."""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch._dynamo
import torch._inductor.config
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_opkit._checks import check_bools, check_globs
from lightning_opkit._dynamo_watch import DynamoWatch, recompile_table
from lightning_opkit._patch import Patches
from lightning_opkit._regions import (
    REGION_HEADERS,
    Region,
    cache_entries,
    compiled_code,
    find_blocks,
    recompile_limit,
    strip_compile_prefix,
)
from lightning_opkit._select import resolve_modules
from lightning_opkit._summary import end_summary, start_summary
from lightning_opkit._suspend import suspending_backend
from lightning_opkit._tensorboard import TensorBoardWriter, markdown_table

__all__ = ["TorchCompile"]


def _backends() -> list[str]:
    return sorted(set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor", "eager", "aot_eager"})


# What counts as "compilation failed" for `fallback`: the backend, dynamo itself, or (with fullgraph) a graph break.
# A user's own error met while tracing (``TorchRuntimeError``, ``Observed*``) or a misuse (``UserError``) is not
# one: it goes through untouched, with nothing switched to eager and nothing run twice.
_ON_RECOMPILE_LIMIT = ("warn", "eager", "raise")
_COMPILE_FAILURES: tuple[type[BaseException], ...] = (
    torch._dynamo.exc.BackendCompilerFailed,
    torch._dynamo.exc.InternalTorchDynamoError,
    torch._dynamo.exc.Unsupported,
    torch._dynamo.exc.InvalidBackend,
    torch._dynamo.exc.UncapturedHigherOrderOpError,
    torch._dynamo.exc.RecompileError,
    torch._dynamo.exc.FailOnRecompileLimitHit,
)


def _check_options(backend: str, options: Any) -> None:
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ValueError(f"Expected `options` to be a dict of Inductor option names to values, but got {options!r}")
    if backend in ("eager", "aot_eager"):
        raise ValueError(f"`options` are read by the inductor backend only; backend={backend!r} would ignore"
                         f" {sorted(options)}. Drop `options` or use backend='inductor'.")
    if backend != "inductor":
        return  # a third-party backend reads its own options
    import difflib

    import torch._inductor.config

    defaults = torch._inductor.config.get_config_copy()
    bad = [k for k in options if k not in defaults]
    if bad:
        hints = {k: difflib.get_close_matches(k, list(defaults), n=3) for k in bad}
        raise ValueError(f"Unknown Inductor option(s) {bad} in `options`; close valid names: {hints}")
    for key, value in options.items():
        default = defaults[key]
        if default is None or value is None:
            continue
        kind = type(default)
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise ValueError(f"`options[{key!r}]` is {value!r}; Inductor expects a {kind.__name__}"
                             f" (default {default!r})")


def _backend(name: str, mode: str | None, options: dict[str, Any] | None,
             dynamic: bool | None) -> Callable[..., Any]:
    # The backend as a callable (what torch.compile builds from a name, mode and options), wrapped so that opkit's
    # precision mode stands aside while it compiles and while its code runs: the mode's casts are already in the graph.
    if name == "inductor":
        backend: Callable[..., Any] = torch._TorchCompileInductorWrapper(mode, options, dynamic)
    else:
        backend = torch._TorchCompileWrapper(name, mode, options, dynamic)
    return suspending_backend(backend)


def _stance() -> str:
    # NaNDetector's replay and PrecisionPolicy's census force eager; a region switched to eager_on_recompile must not
    # override that, nor be timed then.
    from torch._dynamo.eval_frame import _stance as stance

    return stance.stance


def _measure_speedup(module: torch.nn.Module, original: Callable[..., Any], compiled: Callable[..., Any],
                     args: tuple, kwargs: dict, repeats: int = 3) -> float:
    # Extra calls on the step's own inputs: buffers (BatchNorm statistics) and RNG state are put back afterwards, and
    # the outputs are dropped, so training goes on as if they never ran.
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    rng = torch.get_rng_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(repeats):
            for is_compiled, fn in ((False, original), (True, compiled)):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(*args, **kwargs)
                if cuda:
                    torch.cuda.synchronize()
                times[is_compiled].append(time.perf_counter() - t0)
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        torch.set_rng_state(rng)
    return statistics.median(times[False]) / max(statistics.median(times[True]), 1e-9)


def _outermost(named: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    # ``blocks.*`` also matches ``blocks.0.attn``; compiling both would nest compiled regions.
    names = [n for n, _ in named]
    return [(n, m) for n, m in named if not any(n != p and (p == "" or n.startswith(p + ".")) for p in names)]


class TorchCompile(Callback):
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
        measure_speedup: once per region, after it has compiled, time a few eager calls of it against compiled
            calls on the same inputs (buffers and RNG state restored), and report eager / compiled time.

    Example:
        >>> compiler = TorchCompile(modules=["model.blocks.*"], backend="aot_eager")
        >>> trainer = pl.Trainer(callbacks=[compiler], logger=False)
        >>> compiler.backend
        'aot_eager'
    """

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
        measure_speedup: bool = False,
    ) -> None:
        backends = _backends()
        if not isinstance(backend, str) or backend not in backends:
            raise ValueError(f"Expected `backend` to be one of {backends}, but got {backend!r}")
        if mode is not None:
            import torch._inductor

            modes = list(torch._inductor.list_mode_options())
            if mode not in modes:
                raise ValueError(f"Expected `mode` to be one of {modes} or None, but got {mode!r}")
        if options is not None:
            if mode is not None:
                raise ValueError("`mode` and `options` cannot both be set (torch.compile takes one or the other)")
            _check_options(backend, options)
        if modules != "auto":
            check_globs("modules", modules)
        check_bools(fullgraph=fullgraph, fallback=fallback, measure_speedup=measure_speedup)
        if on_recompile_limit not in _ON_RECOMPILE_LIMIT:
            raise ValueError(f"Expected `on_recompile_limit` to be one of {list(_ON_RECOMPILE_LIMIT)}, but got"
                             f" {on_recompile_limit!r}")
        if dynamic is not None and not isinstance(dynamic, bool):
            raise ValueError(f"Expected `dynamic` to be True, False or None, but got {dynamic!r}")
        self.modules: list[str] | str | None = modules if modules in (None, "auto") else list(modules)
        self.backend = backend
        self.mode = mode
        self.fullgraph = fullgraph
        self.dynamic = dynamic
        self.options = dict(options) if options is not None else None
        self.fallback = fallback
        self.on_recompile_limit = on_recompile_limit
        self.measure_speedup = measure_speedup

        #: module paths compiled in this run ("" = the LightningModule)
        self.compiled: list[str] = []
        #: per compiled region: calls, compiles, compile time, graphs, breaks, recompiles, speedup
        self.regions: dict[str, Region] = {}
        #: the compile error, when training fell back to eager
        self.error: str | None = None
        self.step_times_s: list[float] = []
        self.watch = DynamoWatch()
        self._patches = Patches()
        self._writer: TensorBoardWriter | None = None
        self._t0: float | None = None
        self._compiles_at_start = 0
        self._reported: tuple[int, int, int] = (-1, -1, -1)
        self._reported_regions: tuple[Any, ...] = ()
        self._batches = 0
        self._checked_frames = False
        self._hook_guards: Any = None
        self._kernel_profile: Any = None
        self._limit_hit: set[Any] = set()

    # lifecycle

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._patches:
            return  # validate/test inside fit reuse the compiled model
        targets = self._targets(pl_module)
        self.regions = {}
        self._limit_hit = set()
        kwargs = dict(backend=self.backend, mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic,
                      options=self.options)
        compile_kwargs = dict(kwargs, backend=_backend(self.backend, self.mode, self.options, self.dynamic),
                              mode=None, options=None)  # both given to the backend callable
        for name, module in targets:
            # ``forward`` itself, not ``_call_impl``: dynamo converts no frame of a compiled ``_call_impl`` (nor of
            # ``nn.Module.compile()``) for torch.nn's own modules, whose code it skips; a compiled ``forward`` is
            # traced for every module. The module's own hooks then run eagerly around the compiled region.
            original = module.forward
            compiled = torch.compile(original, **compile_kwargs)
            region = self.regions[name] = Region(name, code=compiled_code(compiled))
            self._patches.set(module, "forward", self._guard(trainer, module, region, original, compiled))
        self._patches.set(pl_module, "on_load_checkpoint", self._loading_old_checkpoints(pl_module.on_load_checkpoint))
        self.compiled = [name for name, _ in targets]
        self._batches, self._checked_frames, self.error = 0, False, None
        # Dynamo's default reuses compiled code when hooks were added or removed since (any instance of the class)
        # was compiled, silently skipping them; guarding on hooks makes opkit's and the user's hooks count.
        self._hook_guards = torch._dynamo.config.patch(skip_nnmodule_hook_guards=False)
        self._hook_guards.__enter__()
        # Inductor's CPU kernels then show in profiler windows under their own names (cpp_fused_add_gelu_3), which
        # the taxonomy classifies by the ops they fuse; otherwise their time hides in the graph-call span. The
        # marker in each kernel costs a flag check while no profiler runs.
        self._kernel_profile = torch._inductor.config.patch({"cpp.enable_kernel_profile": True})
        self._kernel_profile.__enter__()
        self.watch.open()
        self._writer = TensorBoardWriter(trainer)
        start_summary(self, trainer, self._writer)
        self._writer.text("opkit/compile/config", markdown_table(
            ["setting", "value"], [["compiled", ", ".join(n or "<LightningModule>" for n in self.compiled)],
                                   *[[k, v] for k, v in kwargs.items()]]), trainer.global_step)

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
        return _outermost(resolve_modules(pl_module, self.modules, owner="TorchCompile"))

    @staticmethod
    def _loading_old_checkpoints(user_hook: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
        # Runs before Lightning loads the weights (a callback's own hook would run after): a checkpoint written by
        # torch.compile's wrapper has ``_orig_mod.`` in its keys, which the plain model does not.
        def on_load_checkpoint(checkpoint: dict[str, Any]) -> Any:
            state = checkpoint.get("state_dict")
            if isinstance(state, dict) and any("_orig_mod." in key for key in state):
                checkpoint["state_dict"] = strip_compile_prefix(state)
                rank_zero_info("TorchCompile: loading a checkpoint with `_orig_mod.` keys into the plain model.")
            return user_hook(checkpoint)

        return on_load_checkpoint

    def _guard(self, trainer: pl.Trainer, module: torch.nn.Module, region: Region, original: Callable[..., Any],
               compiled: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            region.calls += 1
            watch = self.watch
            compiles, recompiles = watch.compiles, len(watch.recompile_reasons)
            watch.region = region
            try:
                # While a profiler window records, the region's time is a span named after it.
                span = (torch.profiler.record_function(f"opkit region {region.name or '<LightningModule>'}")
                        if torch.autograd.profiler._is_profiler_enabled else contextlib.nullcontext())
                with span:
                    if region.eager and _stance() == "default":
                        with torch.compiler.set_stance("eager_on_recompile"):
                            out = compiled(*args, **kwargs)
                    else:
                        out = compiled(*args, **kwargs)
            except _COMPILE_FAILURES as err:
                if not self.fallback:
                    raise
                self._fall_back(trainer, err)
                return original(*args, **kwargs)
            finally:
                watch.region = None
            if len(watch.recompile_reasons) != recompiles:
                region.recompile_reasons += watch.recompile_reasons[recompiles:]
                region.recompiles += len(watch.recompile_reasons) - recompiles
                self._check_recompile_limit(region)
            elif (self.measure_speedup and region.speedup is None and region.calls >= 3
                  and watch.compiles == compiles and _stance() == "default" and torch.is_grad_enabled()):
                region.speedup = _measure_speedup(module, original, compiled, args, kwargs)
            return out

        return forward

    def _check_recompile_limit(self, region: Region) -> None:
        limit = recompile_limit()
        entries = cache_entries(region.code)
        if entries * 2 < limit or region.code in self._limit_hit:
            return
        self._limit_hit.add(region.code)
        sharing = [r.name for r in self.regions.values() if r.code is region.code]
        guard = region.recompile_reasons[-1] if region.recompile_reasons else "-"
        guard = " ".join(guard.split())[:400]
        text = (f"TorchCompile: region {region.name or '<LightningModule>'!r} has {entries} compiled versions of its"
                f" code (shared by {len(sharing)} region(s)), half of torch._dynamo.config.recompile_limit={limit};"
                f" past the limit dynamo silently runs it eagerly. The guard that keeps failing: {guard}")
        if self.on_recompile_limit == "raise":
            raise RuntimeError(text + " (on_recompile_limit='raise')")
        if self.on_recompile_limit == "eager":
            for name in sharing:
                self.regions[name].eager = True
            text += (" These regions now run with set_stance('eager_on_recompile'): compiled code is reused, nothing"
                     " new is compiled.")
        else:
            text += (" Mark the changing dimension dynamic, raise the limit, or set on_recompile_limit='eager'.")
        warnings.warn(text, stacklevel=3)

    def _fall_back(self, trainer: pl.Trainer, err: BaseException) -> None:
        head = str(err).strip().split("\n\n")[0]  # dynamo appends pages of debugging hints after a blank line
        self.error = f"{type(err).__name__}: {' '.join(head.split())}"
        self._patches.restore()  # every compiled region goes back to eager, once
        warnings.warn(f"TorchCompile: compilation failed, training continues eagerly. {self.error}", stacklevel=3)
        if self._writer is not None:
            self._writer.scalar("opkit/compile/eager_fallback", 1, trainer.global_step)
            self._writer.text("opkit/compile/error", f"Compilation failed; training continues eagerly.\n\n"
                                                     f"```\n{err}\n```", trainer.global_step)
            self._writer.flush()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            end_summary(self, trainer, self._writer)
        self._detach(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        end_summary(self, trainer, self._writer, exception)
        self._detach(trainer)

    def summary_lines(self) -> list[str]:
        """This callback's lines of the run summary."""
        watch = self.watch
        regions = ", ".join(n or "<LightningModule>" for n in self.compiled[:4]) + (
            f" (+{len(self.compiled) - 4} more)" if len(self.compiled) > 4 else "")
        line = (f"compile ({self.backend}): {watch.compile_time_s:.1f} s compiling, {watch.graphs} graph(s),"
                f" {sum(watch.graph_breaks().values())} graph break(s), {len(watch.recompile_reasons)} recompile(s);"
                f" regions: {regions or '-'}")
        lines = [line]
        if self.error is not None:
            lines.append(f"  fell back to eager: {self.error[:200]}")
        return lines

    def _detach(self, trainer: pl.Trainer) -> None:
        if self._writer is not None:
            self._log(trainer, final=True)
            self._writer.close()
            self._writer = None
        self._patches.restore()
        self.watch.close()
        if self._hook_guards is not None:
            self._hook_guards.__exit__(None, None, None)
            self._hook_guards = None
        if self._kernel_profile is not None:
            self._kernel_profile.__exit__(None, None, None)
            self._kernel_profile = None

    # observability

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._compiles_at_start = self.watch.compiles
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._t0 is not None and self.watch.compiles == self._compiles_at_start and self.error is None:
            self.step_times_s.append(time.perf_counter() - self._t0)  # steady state: nothing compiled this step
        self._t0 = None
        self._batches += 1
        if self._batches >= 2:
            self._check_frames()
        self._log(trainer, final=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._batches:
            self._check_frames()

    def _check_frames(self) -> None:
        # Judged by frames dynamo converted, not by calls into the wrapper, after two batches: a census or NaN
        # replay runs a step eagerly on purpose.
        if self._checked_frames:
            return
        self._checked_frames = True
        if self.error is not None:
            return
        watch = self.watch
        # Compiled code from an earlier fit (dynamo's cache is per code object) runs without converting a frame.
        if watch.frames == 0 and not any(cache_entries(r.code) for r in self.regions.values()):
            if watch.frames_attempted:
                hint = (f"It tried {watch.frames_attempted} frame(s) of {self.compiled} and skipped them (run with"
                        " TORCH_LOGS=graph_breaks to see why); they run eagerly.")
            elif self.modules is None:
                hint = ("With modules=None only the LightningModule's forward is compiled, so training_step must"
                        " call self(...); or name the submodules it does call in `modules`.")
            else:
                hint = f"Are the modules {self.compiled} called in training_step?"
            warnings.warn(f"TorchCompile: nothing was compiled in the first {self._batches} training step(s):"
                          f" dynamo converted no frame. {hint}", stacklevel=2)
        elif watch.frames and watch.graphs == 0:
            breaks = ", ".join(list(watch.graph_breaks())[:3]) or "-"
            warnings.warn(f"TorchCompile: nothing was compiled in the first {self._batches} training step(s):"
                          f" dynamo converted {watch.frames} frame(s) of {self.compiled} but captured no graph, so"
                          f" they run eagerly. Graph breaks: {breaks}", stacklevel=2)

    def _log(self, trainer: pl.Trainer, final: bool) -> None:
        writer = self._writer
        if writer is None or not writer.active:
            return
        step = trainer.global_step
        watch = self.watch
        breaks = watch.graph_breaks()
        state = (watch.compiles, sum(breaks.values()), len(watch.recompile_reasons))
        if state != self._reported:
            self._reported = state
            writer.scalar("opkit/compile/compile_time_s", watch.compile_time_s, step)
            writer.scalar("opkit/compile/compiles", watch.compiles, step)
            writer.scalar("opkit/compile/graphs", watch.graphs, step)
            writer.scalar("opkit/compile/graph_breaks", sum(breaks.values()), step)
            writer.scalar("opkit/compile/recompiles", len(watch.recompile_reasons), step)
            if breaks:
                writer.table("opkit/compile/graph_break_reasons", ["reason", "count"],
                             sorted(breaks.items(), key=lambda kv: -kv[1]), step)
            if watch.recompile_reasons:
                writer.table("opkit/compile/recompile_reasons", ["function", "guard that failed", "count"],
                             recompile_table(watch.recompile_reasons), step)
        regions = tuple((r.compiles, r.recompiles, r.speedup, r.eager) for r in self.regions.values())
        if regions != self._reported_regions or final:
            self._reported_regions = regions
            writer.table("opkit/compile/regions", REGION_HEADERS, [r.row() for r in self.regions.values()], step)
            writer.scalar("opkit/compile/eager_regions", sum(r.eager for r in self.regions.values()), step)
        steady = self.step_times_s
        if steady and (final or len(steady) % max(1, trainer.log_every_n_steps) == 0):
            writer.scalar("opkit/compile/step_time_ms", 1e3 * statistics.median(steady[-100:]), step)
        if final:
            writer.flush()
