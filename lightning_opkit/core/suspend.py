"""Let opkit's ``TorchFunctionMode`` stand aside while compiled code is built and run.

Dynamo traces the precision policy's mode into each graph: the casts it decided are graph nodes. The graph then runs
while the mode is still on the stack, and a backend that replays the graph through torch functions (the ``eager``
backend's FX code, ``aot_autograd``'s retracing, Inductor's extern kernels) would meet the mode a second time, which
decides again with the module stack of the moment, not the traced one: module overrides lost, dtypes mixed.
``TorchCompile`` runs its backend's compilation and the compiled code inside ``SUSPENDED.scope()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lightning_opkit.core.dynamo_compat import keep_boxed_call
from lightning_opkit.core.patch import Nesting

__all__ = ["SUSPENDED", "suspending_backend"]

#: while true, opkit's function modes pass every call through untouched; they read ``SUSPENDED.depth`` on every op
SUSPENDED = Nesting()


def suspending_backend(backend: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a ``torch.compile`` backend: its compilation and the code it returns run inside ``SUSPENDED.scope()``.

    Args:
        backend: a backend callable ``(graph_module, example_inputs) -> compiled``.

    Example:
        >>> import torch
        >>> f = torch.compile(lambda x: x + 1, backend=suspending_backend(torch._dynamo.lookup_backend("eager")))
        >>> f(torch.zeros(1))
        tensor([1.])
    """

    def compile_graph(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        with SUSPENDED.scope():
            compiled = backend(gm, example_inputs, **kwargs)

        @functools.wraps(compiled)
        def run(*args: Any) -> Any:
            with SUSPENDED.scope():
                return compiled(*args)

        keep_boxed_call(compiled, run)
        return run

    # What dynamo and torch read off a backend (its name in logs, Inductor's config, the reset of its caches).
    for attr in ("compiler_name", "get_compiler_config", "reset"):
        if hasattr(backend, attr):
            setattr(compile_graph, attr, getattr(backend, attr))
    return compile_graph
