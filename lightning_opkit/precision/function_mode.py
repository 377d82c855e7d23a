"""The ``TorchFunctionMode`` that runs each op in the dtype of its class (or of the module it runs in)."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_opkit.core.dtypes import autocast_off
from lightning_opkit.core.dynamo_compat import skip_code
from lightning_opkit.core.patch import Patches
from lightning_opkit.core.recompute import RECOMPUTING
from lightning_opkit.core.replay import rng_state
from lightning_opkit.core.suspend import SUSPENDED
from lightning_opkit.core.torch_compat import HigherOrderOperator
from lightning_opkit.opclass import function_info
from lightning_opkit.precision.census import UPDATED_ARGS, Census, fp32_reference
from lightning_opkit.precision.dtypes import NEVER_CAST, cast, mode_dtype


class ModeState:
    """What the mode reads on every op: the class table, the module-override stack, autocast, the census.

    Args:
        table: op class -> dtype name (``"keep"`` for classes left alone).
    """

    def __init__(self, table: dict[str, str]) -> None:
        self.class_dtypes: dict[str, torch.dtype | None] = {}
        self.module_stack: list[torch.dtype | None] = []
        self.autocast_devices: list[str] = []
        self.census: Census | None = None
        self.set_table(table)

    def set_table(self, table: dict[str, str]) -> None:
        """Replace the class table in place (compiled code guards on its contents and recompiles once)."""
        self.class_dtypes.clear()
        self.class_dtypes.update({cls: mode_dtype(name) for cls, name in table.items()})


_INFO: dict[Any, tuple[str, bool]] = {}
#: what a higher-order operator is to the mode: no op of a class, but a body of ops to govern
_BODY = "higher-order operator"
#: a backward run inside a governed step (manual optimization): in the forward's dtypes, autocast off
_BACKWARD = "backward"
_SPECIAL = frozenset((_BODY, _BACKWARD))
_PASS = frozenset((*NEVER_CAST, *_SPECIAL))
_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
# Bound once: the hot path calls them on every op (dynamo recognises the function objects themselves)
_is_compiling = torch.compiler.is_compiling
_autocast_enabled, _set_autocast = torch.is_autocast_enabled, torch.set_autocast_enabled
# Op names that draw random numbers (by name, as a ``TorchFunctionMode`` receives them)
_RANDOM = ("dropout", "bernoulli", "rand", "normal", "multinomial", "poisson", "rrelu", "exponential", "uniform")


def policy_info(func: Callable[..., Any]) -> tuple[str, bool]:
    """``(op class, in-place?)`` as the policy sees it: ops that draw random numbers are never cast.

    Dropout in its input's dtype draws the same mask it would in fp32's place; cast, the mask would change with the
    dtype (bf16 and fp32 consume the random stream differently), which is not a precision effect.
    """
    try:
        return _INFO[func]
    except KeyError:
        pass
    except TypeError:
        return function_info(func)
    if isinstance(func, HigherOrderOperator) or func in _BACKWARDS:
        _INFO[func] = (_BACKWARD if func in _BACKWARDS else _BODY, False)
        return _INFO[func]
    cls, inplace = function_info(func)
    random = any(word in (getattr(func, "__name__", "") or "") for word in _RANDOM)
    info = _INFO[func] = ("other" if random else cls), inplace
    return info


@torch.compiler.assume_constant_result
def _traced_function_info(func: Callable[..., Any]) -> tuple[str, bool]:
    # Eagerly a plain cached lookup. Dynamo can neither trace str methods on a function's name nor guard on a
    # cache that grows (it would recompile each time), so it runs this once at trace time and keeps the result.
    return policy_info(func)


def _cast_updated(func: Any, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict, list]:
    positions, names = UPDATED_ARGS[func]
    written: list[tuple[Tensor, Tensor]] = []

    def cast_one(value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != dtype:
            copy = value.to(dtype)
            written.append((value, copy))
            return copy
        return value

    args = tuple(cast_one(a) if i in positions else a for i, a in enumerate(args))
    kwargs = {k: cast_one(v) if k in names else v for k, v in kwargs.items()}
    return args, kwargs, written


class PolicyMode(TorchFunctionMode):
    """Casts the floating inputs of each governed op to its dtype and runs it with autocast off.

    Args:
        state: the table, override stack, autocast devices and census to follow.
    """

    def __init__(self, state: ModeState) -> None:
        super().__init__()
        self.state = state

    # One function on purpose: every torch call of an eager step runs it, and each call or attribute lookup split
    # out of it costs host time per op (benchmarks/host_cost.py measures it).
    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),  # noqa: C901
                           kwargs: dict | None = None) -> Any:
        if _is_compiling():
            return self._governed(func, args, kwargs or {}, True)
        # The eager hot path: every torch call of the step comes through here, so it does one dict lookup, reads the
        # table, and casts with the cheapest call that does it (``to(dtype=...)`` parses fastest of the ``to`` forms).
        try:
            cls, inplace = _INFO[func]
        except (KeyError, TypeError):
            cls, inplace = policy_info(func)
        if cls in _PASS or SUSPENDED.depth:
            if cls in _SPECIAL and not SUSPENDED.depth:
                return self._special(cls, func, args, kwargs or {})
            return func(*args, **(kwargs or {}))
        state = self.state
        if state.census is not None:
            return self._governed(func, args, kwargs or {}, False)
        stack = state.module_stack
        dtype = stack[-1] if stack else state.class_dtypes[cls]
        devices = state.autocast_devices
        if devices and not _autocast_enabled(devices[0]):
            if not stack:
                return func(*args, **(kwargs or {}))  # the user turned autocast off here: their code runs as written
            devices = []  # off already (a replay's fp32 region inside an override): nothing to turn off and on
        if dtype is None or inplace or (kwargs and "out" in kwargs):
            return func(*args, **(kwargs or {}))
        if func in UPDATED_ARGS:
            return self._governed(func, args, kwargs or {}, False)
        cast_args = [(a.to(dtype=dtype) if a.dtype != dtype and a.is_floating_point() else a)
                     if isinstance(a, Tensor) else (cast(a, dtype) if isinstance(a, (list, tuple)) else a)
                     for a in args]
        kwargs = {k: cast(v, dtype) for k, v in kwargs.items()} if kwargs else {}
        if not devices:
            return func(*cast_args, **kwargs)
        # The policy, not autocast, decides: autocast would recast the inputs just cast.
        _set_autocast(devices[0], False)
        try:
            return func(*cast_args, **kwargs)
        finally:
            _set_autocast(devices[0], True)

    def _governed(self, func: Callable[..., Any], args: tuple, kwargs: dict, compiling: bool) -> Any:
        """The general path: traced under compile, and eagerly for census steps and ops that update their args."""
        state = self.state
        cls, inplace = _traced_function_info(func)
        if cls in _SPECIAL and not SUSPENDED.depth:
            return self._special(cls, func, args, kwargs)
        if cls in _PASS or SUSPENDED.depth:
            return func(*args, **kwargs)
        stack = state.module_stack
        if state.autocast_devices and not stack and not torch.is_autocast_enabled(state.autocast_devices[0]):
            return func(*args, **kwargs)  # the user turned autocast off here: their code runs as written
        dtype = stack[-1] if stack else state.class_dtypes[cls]
        given_args, given_kwargs = args, kwargs  # what the caller passed: the census recomputes from it
        census = state.census
        if census is not None and RECOMPUTING.depth:  # an activation checkpoint's recompute: counted once
            census = None  # (read only on a census step, which runs eagerly: compiled code never guards on it)
        rng = rng_state() if not compiling and census is not None else None  # census steps only
        if dtype is None or inplace or "out" in kwargs:
            out = func(*args, **kwargs)
        else:
            out = self._cast_and_run(func, args, kwargs, dtype, compiling)
        if rng is not None and census is not None:
            # Census steps only: the op again in fp32 on the inputs it was given, for its error and underflow.
            ref = None
            if not inplace and "out" not in kwargs and census.wants_reference(out):
                ref = fp32_reference(func, given_args, given_kwargs, rng)
            census.record(cls, out, bool(stack), ref)
        return out

    def _special(self, cls: str, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A call that is no op to cast: a higher-order operator's body, or a backward inside the step.

        A higher-order operator (dynamo's checkpoint, ``cond``, flex attention) has nothing to cast, but the ops of
        the Python it runs do (a checkpointed block traced whole: its convolution met a 16-bit input and fp32
        weights). A mode handling a call stands aside until it returns, and entered again around the call it would be
        handed the same call again; so the functions the operator runs enter it themselves.

        A backward inside the step (``manual_backward`` under manual optimization) runs in the dtypes the forward
        ran in: with autocast on there, a fp16 autocast met the policy's bf16 ops and refused to promote them.
        """
        if cls == _BACKWARD:
            with autocast_off():
                return func(*args, **kwargs)
        return func(*(self._entering(a) for a in args), **kwargs)

    def _entering(self, value: Any) -> Any:
        if not isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            return value

        @functools.wraps(value)
        def governed(*args: Any, **kwargs: Any) -> Any:
            with self:
                return value(*args, **kwargs)

        return governed

    def _cast_and_run(self, func: Callable[..., Any], args: tuple, kwargs: dict, dtype: torch.dtype,
                      compiling: bool) -> Any:
        written: list[tuple[Tensor, Tensor]] = []
        if func in UPDATED_ARGS:
            args, kwargs, written = _cast_updated(func, args, kwargs, dtype)
        args = tuple(cast(a, dtype) for a in args)
        kwargs = {k: cast(v, dtype) for k, v in kwargs.items()} if kwargs else {}
        devices = self.state.autocast_devices
        if not devices:
            out = func(*args, **kwargs)
        else:
            # The policy, not autocast, decides: autocast would recast the inputs just cast.
            with _autocast_off(devices[0], compiling):
                out = func(*args, **kwargs)
        if written:
            with torch.no_grad():
                for buffer, copy in written:
                    buffer.copy_(copy)
        return out


def _autocast_off(device: str, compiling: bool) -> Any:
    if compiling:
        return torch.autocast(device, enabled=False)  # traced: the context manager is what dynamo understands
    return autocast_off()


def match_weight_dtype(module: torch.nn.Module, args: tuple) -> tuple | None:
    """A forward pre-hook for ``nn.LSTM``/``GRU``/``RNN``: their input in their weights' dtype."""
    # nn.LSTM/GRU/RNN check in Python that their input has their weights' dtype before the op the policy governs
    # runs; an input from a policy-cast op upstream (a bf16 GEMM) would fail that check.
    weight = next(iter(module.parameters()), None)
    if weight is None or not args or not isinstance(args[0], Tensor):
        return None
    if not args[0].is_floating_point() or args[0].dtype == weight.dtype:
        return None
    return (args[0].to(weight.dtype), *args[1:])


def hold_rnn_input_casts(patches: Patches, model: torch.nn.Module) -> None:
    """Every ``nn.LSTM``/``GRU``/``RNN`` of ``model`` gets :func:`match_weight_dtype` as its first pre-hook.

    Args:
        patches: where the hook handles are kept (restored by the owner).
        model: the root module.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.RNNBase):
            patches.hold(module.register_forward_pre_hook(match_weight_dtype, prepend=True))


def keep_out_of_dynamo_frames() -> None:
    """Stop dynamo compiling the mode's ``__torch_function__`` as a frame of its own (it still inlines it)."""
    # Dynamo inlines the mode while tracing a compiled region, with ``func`` a constant of the call site. Between graph
    # breaks it would also compile ``__torch_function__`` as a frame of its own, where the constant-folded op class
    # ignores ``func`` and a graph traced for one op is replayed for another (``Tensor.dtype`` returning 3). Skipping
    # that frame keeps the mode eager there and traced where it is inlined.
    skip_code(PolicyMode.__torch_function__.__code__)
