"""TorchCompile: optional, in-place, optionally regional torch.compile, observable and checkpoint-safe."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch._dynamo
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_opkit._checks import check_bools, check_globs
from lightning_opkit._dynamo_watch import DynamoWatch
from lightning_opkit._modes import standing_aside
from lightning_opkit._modules import resolve_modules
from lightning_opkit._patch import Patches
from lightning_opkit._tensorboard import TensorBoardWriter, markdown_table

__all__ = ["TorchCompile"]


def _backends() -> list[str]:
    return sorted(set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor", "eager", "aot_eager"})


# What counts as "compilation failed" for `fallback`: the backend, dynamo itself, or (with fullgraph) a graph break.
# A user's own error met while tracing (``TorchRuntimeError``, ``Observed*``) or a misuse (``UserError``) is not
# one: it goes through untouched, with nothing switched to eager and nothing run twice.
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
    return standing_aside(backend)


def _has_cached_code(compiled: Callable[..., Any]) -> bool:
    # Compiled code from an earlier fit (dynamo's cache is per code object) runs without converting a new frame.
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    fn = getattr(compiled, "_torchdynamo_orig_callable", None)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return code is not None and bool(_debug_get_cache_entry_list(code))


def _outermost(named: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    # ``blocks.*`` also matches ``blocks.0.attn``; compiling both would nest compiled regions.
    names = [n for n, _ in named]
    return [(n, m) for n, m in named if not any(n != p and (p == "" or n.startswith(p + ".")) for p in names)]


class TorchCompile(Callback):
    """Compile the model (or each submodule matching a glob) in place with ``torch.compile``, and report on it.

    Compilation is in place, the way ``nn.Module.compile`` does it: the module object, its ``state_dict`` keys and
    checkpoints are those of the uncompiled model (no ``_orig_mod.``), so a checkpoint saved while compiled loads into
    a plain model and vice versa. With ``modules``, each matching submodule is compiled on its own (regional
    compilation): identical blocks share one compiled code object and compile once.

    Args:
        modules: globs over ``named_modules()`` names of submodules to compile; ``None`` compiles the
            LightningModule's ``forward`` (what ``self(x)`` in ``training_step`` calls).
        backend: a ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, ``"eager"``, ...).
        mode: an Inductor mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``, ...); not with ``options``.
        fullgraph: fail on any graph break instead of splitting the graph.
        dynamic: ``True`` / ``False`` forces dynamic / static shapes; ``None`` lets dynamo mark a dimension dynamic
            after its first change (so a smaller last batch or an evaluation batch size recompiles once, not per size).
        options: Inductor options such as ``{"triton.cudagraphs": True}``; keys are checked against Inductor's.
        fallback: when compilation fails, warn once, log the error, and go on eagerly; ``False`` raises.

    Example:
        >>> compiler = TorchCompile(modules=["model.blocks.*"], backend="aot_eager")
        >>> trainer = pl.Trainer(callbacks=[compiler], logger=False)
        >>> compiler.backend
        'aot_eager'
    """

    def __init__(
        self,
        modules: Optional[list[str]] = None,
        backend: str = "inductor",
        mode: Optional[str] = None,
        fullgraph: bool = False,
        dynamic: Optional[bool] = None,
        options: Optional[dict[str, Any]] = None,
        fallback: bool = True,
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
        check_globs("modules", modules)
        check_bools(fullgraph=fullgraph, fallback=fallback)
        if dynamic is not None and not isinstance(dynamic, bool):
            raise ValueError(f"Expected `dynamic` to be True, False or None, but got {dynamic!r}")
        self.modules = list(modules) if modules is not None else None
        self.backend = backend
        self.mode = mode
        self.fullgraph = fullgraph
        self.dynamic = dynamic
        self.options = dict(options) if options is not None else None
        self.fallback = fallback

        #: module paths compiled in this run ("" = the LightningModule)
        self.compiled: list[str] = []
        #: the compile error, when training fell back to eager
        self.error: str | None = None
        self.step_times_s: list[float] = []
        self.watch = DynamoWatch()
        self._patches = Patches()
        self._writer: TensorBoardWriter | None = None
        self._t0: float | None = None
        self._compiles_at_start = 0
        self._reported: tuple[int, int, int] = (-1, -1, -1)
        self._batches = 0
        self._checked_frames = False
        self._compiled_fns: list[Callable[..., Any]] = []
        self._hook_guards: Any = None

    # lifecycle

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._patches:
            return  # validate/test inside fit reuse the compiled model
        targets = [("", pl_module)] if self.modules is None else _outermost(
            resolve_modules(pl_module, self.modules, owner="TorchCompile"))
        self._compiled_fns = []
        kwargs = dict(backend=self.backend, mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic,
                      options=self.options)
        compile_kwargs = dict(kwargs, backend=_backend(self.backend, self.mode, self.options, self.dynamic),
                              mode=None, options=None)  # both given to the backend callable
        for _, module in targets:
            # ``forward`` itself, not ``_call_impl``: dynamo converts no frame of a compiled ``_call_impl`` (nor of
            # ``nn.Module.compile()``) for torch.nn's own modules, whose code it skips; a compiled ``forward`` is
            # traced for every module. The module's own hooks then run eagerly around the compiled region.
            original = module.forward
            compiled = torch.compile(original, **compile_kwargs)
            self._patches.set(module, "forward", self._guard(trainer, original, compiled))
            self._compiled_fns.append(compiled)
        self.compiled = [name for name, _ in targets]
        self._batches, self._checked_frames, self.error = 0, False, None
        # Dynamo's default reuses compiled code when hooks were added or removed since (any instance of the class)
        # was compiled, silently skipping them; guarding on hooks makes opkit's and the user's hooks count.
        self._hook_guards = torch._dynamo.config.patch(skip_nnmodule_hook_guards=False)
        self._hook_guards.__enter__()
        self.watch.open()
        self._writer = TensorBoardWriter(trainer)
        self._writer.text("opkit/compile/config", markdown_table(
            ["setting", "value"], [["compiled", ", ".join(n or "<LightningModule>" for n in self.compiled)],
                                   *[[k, v] for k, v in kwargs.items()]]), trainer.global_step)

    def _guard(self, trainer: pl.Trainer, original: Callable[..., Any],
               compiled: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            try:
                return compiled(*args, **kwargs)
            except _COMPILE_FAILURES as err:
                if not self.fallback:
                    raise
                self._fall_back(trainer, err)
                return original(*args, **kwargs)

        return forward

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
        self._detach(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._detach(trainer)

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
        if watch.frames == 0 and not any(map(_has_cached_code, self._compiled_fns)):
            hint = ("With modules=None only the LightningModule's forward is compiled, so training_step must call"
                    " self(...); or name the submodules it does call in `modules`." if self.modules is None else
                    f"Are the modules {self.compiled} called in training_step?")
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
                writer.text("opkit/compile/recompile_reasons",
                            "\n\n".join(f"```\n{r}\n```" for r in watch.recompile_reasons[-20:]), step)
        steady = self.step_times_s
        if steady and (final or len(steady) % max(1, trainer.log_every_n_steps) == 0):
            writer.scalar("opkit/compile/step_time_ms", 1e3 * statistics.median(steady[-100:]), step)
        if final:
            writer.flush()
