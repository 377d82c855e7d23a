"""Private names of dynamo and Inductor that opkit reads or calls, each behind one name here.

``torch.compile`` has a public surface (``torch.compile``, ``torch.compiler.set_stance``, ``torch.compiler.disable``);
what TorchCompile reports and decides needs more: the stance in force, a code object's cache entries, dynamo's
counters and compile callbacks, the ``recompiles`` log artifact, the backend wrappers ``torch.compile`` builds from a
name, Inductor's modes and options, the exceptions that mean "compilation failed". None has a public name on the
supported releases; a torch that moves one is mended in this file (``tests/core/test_dynamo_compat.py`` finds each on
the running torch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo

__all__ = ["COMPILE_FAILURES", "RECOMPILES_LOGGER", "backend_callable", "backward_outside_autocast", "cache_entries",
           "compiled_code", "counters", "guard_on_hooks", "inductor_defaults", "inductor_kernel_names",
           "inductor_modes", "keep_boxed_call", "recompile_limit", "recompiles_artifact", "skip_code", "stance",
           "watch_compiles"]

# What counts as "compilation failed" for TorchCompile's `fallback`: the backend, dynamo itself, or (with fullgraph) a
# graph break. A user's own error met while tracing (``TorchRuntimeError``, ``Observed*``) or a misuse (``UserError``)
# is not one: it goes through untouched, with nothing switched to eager and nothing run twice.
COMPILE_FAILURES: tuple[type[BaseException], ...] = (
    torch._dynamo.exc.BackendCompilerFailed,
    torch._dynamo.exc.InternalTorchDynamoError,
    torch._dynamo.exc.Unsupported,
    torch._dynamo.exc.InvalidBackend,
    torch._dynamo.exc.UncapturedHigherOrderOpError,
    torch._dynamo.exc.RecompileError,
    torch._dynamo.exc.FailOnRecompileLimitHit,
)

#: the logger dynamo writes each recompile's failed guard to, once the ``recompiles`` artifact is on
RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"


def stance() -> str:
    """The stance ``torch.compiler.set_stance`` put in force (``"default"`` unless something forces eager).

    Example:
        >>> with torch.compiler.set_stance("force_eager"):
        ...     stance()
        'force_eager'
    """
    from torch._dynamo.eval_frame import _stance

    return _stance.stance


def cache_entries(code: Any) -> int:
    """Dynamo's cache entries of a code object: the compiled versions ``recompile_limit`` counts (0 for ``None``)."""
    if code is None:
        return 0
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))


def skip_code(code: Any) -> None:
    """Never compile ``code`` as a frame of its own (dynamo still inlines it into a frame that calls it)."""
    from torch._dynamo.eval_frame import skip_code as skip

    skip(code)


def counters() -> Any:
    """The process-wide counters of dynamo: ``frames`` (``ok``, ``total``), ``stats``, ``graph_break``."""
    from torch._dynamo.utils import counters as found

    return found


def watch_compiles(start: Callable[..., Any], end: Callable[..., Any], on: bool) -> None:
    """Register (``on``) or remove the callbacks dynamo calls as each compilation starts and ends.

    Removing a callback never registered is no error (a watch closed after a half-done open).
    """
    handler = torch._dynamo.callback_handler
    if on:
        handler.register_start_callback(start)
        handler.register_end_callback(end)
        return
    for remove, fn in ((handler.remove_start_callback, start), (handler.remove_end_callback, end)):
        with contextlib.suppress(ValueError):
            remove(fn)


def recompiles_artifact(enable: bool | None = None) -> bool:
    """Whether dynamo logs recompile reasons (its ``recompiles`` artifact); ``enable`` turns it on or off first."""
    from torch._logging._internal import log_state

    if enable is True:
        log_state.enable_artifact("recompiles")
    elif enable is False:
        log_state.artifact_names.discard("recompiles")
    return bool(log_state.is_artifact_enabled("recompiles"))


def backend_callable(name: str, mode: str | None, options: dict[str, Any] | None,
                     dynamic: bool | None) -> Callable[..., Any]:
    """The backend callable ``torch.compile`` builds from a backend name, a mode and options."""
    if name == "inductor":
        return torch._TorchCompileInductorWrapper(mode, options, dynamic)
    return torch._TorchCompileWrapper(name, mode, options, dynamic)


def inductor_modes() -> list[str]:
    """Inductor's ``mode`` names (``"default"``, ``"reduce-overhead"``, ...)."""
    import torch._inductor

    return list(torch._inductor.list_mode_options())


def inductor_defaults() -> dict[str, Any]:
    """Inductor's options and their defaults, by name: what ``torch.compile(options=...)`` may set."""
    import torch._inductor.config

    return dict(torch._inductor.config.get_config_copy())


def backward_outside_autocast() -> Any:
    """A config patch under which a compiled region's backward runs outside autocast, as eager's does.

    AOTAutograd traces a region's backward when it compiles the forward, by default under the autocast in force then
    (``backward_pass_autocast="same_as_forward"``): under ``precision="bf16-mixed"`` a compiled block's backward
    GEMMs ran in bf16 where eager's run in the dtypes the forward saved (fp32 where the forward ran in fp32: autocast's
    fp32 ops, a policy's fp32 classes, a user's ``autocast(enabled=False)``). PyTorch means to make ``"off"`` its
    default (pytorch/pytorch#177287). A torch without the setting gets a patch that does nothing.
    """
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "backward_pass_autocast"):
        return contextlib.nullcontext()
    return functorch_config.patch(backward_pass_autocast="off")


def compiled_code(compiled: Any) -> Any:
    """The code object dynamo caches a ``torch.compile``d callable on."""
    fn = getattr(compiled, "_torchdynamo_orig_callable", None)
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


def recompile_limit() -> int:
    """Dynamo's per-code-object limit of cache entries (``recompile_limit``, formerly ``cache_size_limit``)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8)))


def guard_on_hooks() -> Any:
    """A config patch under which dynamo guards on a module's hooks (compiled code is not reused past a hook change).

    Dynamo's default reuses compiled code when hooks were added or removed since (any instance of the class) was
    compiled, silently skipping them; guarding on hooks makes opkit's and the user's hooks count.
    """
    return torch._dynamo.config.patch(skip_nnmodule_hook_guards=False)


def inductor_kernel_names() -> Any:
    """A config patch under which Inductor's CPU kernels show in profiler windows under their own names.

    A name such as ``cpp_fused_add_gelu_3`` the taxonomy classifies by the ops it fuses; otherwise the kernels' time
    hides in the graph-call span. The marker in each kernel costs a flag check while no profiler runs.
    """
    import torch._inductor.config

    return torch._inductor.config.patch({"cpp.enable_kernel_profile": True})


def keep_boxed_call(compiled: Any, wrapper: Any) -> None:
    """Mark ``wrapper`` (around a backend's compiled callable) as taking its arguments boxed where ``compiled`` does.

    AOTAutograd hands a boxed callable one list, which it may clear to free the inputs early; a wrapper that does not
    say so is called unboxed.
    """
    if getattr(compiled, "_boxed_call", False):
        wrapper._boxed_call = True
