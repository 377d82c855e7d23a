"""float8 all-gather under FSDP2: a float8 module's weight shards are cast to float8 before FSDP2 gathers them.

A float8 GEMM casts its weight to float8 anyway; gathering the float8 shard (torchao's
``WeightWithDynamicFloat8CastTensor``: one amax all-reduce for the scale, then 1 byte per element) sends a quarter of
fp32's bytes and half of bf16's, and the gathered weight reaches the GEMM already cast.

torchao sets this up by swapping each weight for the wrapped tensor before ``fully_shard``. The kit installs it after
the strategy has sharded the model, on FSDP2's own parameter: the wrapped tensor becomes its DTensor's local shard
over the same storage. So the parameter objects (the optimizer's), their values and a checkpoint's keys stay; a
``state_dict`` hook hands out the plain shard (a checkpoint loads into a model without torchao); :meth:`release` puts
the plain shard back and has FSDP2 build its gathered parameter afresh (a repair's pin, teardown).

FSDP2's parameter internals are private: a torch whose FSDP2 lacks what this reads, a parameter sharded unevenly, on
a mesh of more than one dimension or resharded after forward to a smaller group, leaves that module gathered in its
usual dtype, named once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_opkit.core.dtypes import autocast_off
from lightning_opkit.core.fsdp import gathers_extensions, local_shard, swap_local_shard, weight_records
from lightning_opkit.core.suspend import SUSPENDED
from lightning_opkit.core.text import named_reasons
from lightning_opkit.core.torch_compat import foreach_norm
from lightning_opkit.core.torchao_compat import float8_dtype, set_scale, wrapped_in

__all__ = ["Float8AllGather", "float8_weight", "gather_lines", "high_precision"]


@functools.cache
def _float8_tensor() -> type | None:
    try:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor
    except Exception:  # no torchao, or one that does not import with this torch: nothing is gathered in float8
        return None
    return Float8TrainingTensor


def float8_weight(t: Tensor) -> bool:
    """Whether ``t`` is a weight FSDP2 gathered in float8 (torchao's ``Float8TrainingTensor``).

    Example:
        >>> float8_weight(torch.ones(2))
        False
    """
    cls = _float8_tensor()
    return cls is not None and isinstance(t, cls)


def high_precision(t: Tensor) -> Tensor:
    """``t`` itself, or a float8-gathered weight back in its high-precision dtype (differentiably).

    Example:
        >>> high_precision(torch.ones(2))
        tensor([1., 1.])
    """
    return t.to_original_precision() if float8_weight(t) else t  # type: ignore[attr-defined]


@dataclasses.dataclass
class _Held:
    """One module's FSDP2 weight parameter gathered in float8: what to put back."""

    fsdp_param: Any
    owner: nn.Module
    plain_local: Tensor
    plain_data: Tensor
    hook: RemovableHandle


def _standing_aside(pre_all_gather: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The cast before the gather (torchao's), with the policy's mode and autocast aside: not the model's ops."""

    def fsdp_pre_all_gather(mesh: Any) -> Any:  # FSDP2 reads the signature: the mesh alone, as torchao's
        with SUSPENDED.scope(), autocast_off():
            return pre_all_gather(mesh)

    return fsdp_pre_all_gather


def _plain_state() -> Any:
    """A ``state_dict`` post-hook handing out a module's plain weight shard rather than the float8-cast one."""

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        from torch.distributed.tensor import DTensor

        key = prefix + "weight"
        value: Any = state_dict.get(key)
        plain = wrapped_in(value.to_local()) if isinstance(value, DTensor) else None
        if plain is not None:
            state_dict[key] = DTensor.from_local(plain, value.device_mesh, value.placements, run_check=False,
                                                 shape=value.shape, stride=value.stride())

    return hook


class Float8AllGather:
    """The float8 modules whose weight FSDP2 gathers in float8, and those it could not (with why).

    Example:
        >>> gather = Float8AllGather()
        >>> gather.install(nn.Sequential(nn.Linear(16, 16)), {"0": None}, None, None)  # not sharded: nothing to gather
        >>> gather.live, gather.note
        ([], 'the model has no FSDP2-sharded parameter: nothing is gathered')
    """

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._step_hooks: list[RemovableHandle] = []
        #: the modules whose weight FSDP2 gathers in float8 (after teardown: those it gathered so in the last fit)
        self.gathered: list[str] = []
        #: module path -> why its weight is gathered in its usual dtype
        self.skipped: dict[str, str] = {}
        #: why nothing was gathered in float8 (``""``: see :attr:`gathered` and :attr:`skipped`)
        self.note = ""

    @property
    def live(self) -> list[str]:
        """The modules whose weight is gathered in float8 now."""
        return list(self._held)

    def install(self, model: nn.Module, modules: dict[str, Any], mm_config: Any, config: Any) -> None:
        """Gather each of ``modules`` (path -> module; ``None``: look it up) in float8 where FSDP2 shards its weight.

        Args:
            model: the root module.
            modules: the float8 modules.
            mm_config: torchao's GEMM configs (the wrapped weight casts as the module's GEMM would).
            config: torchao's ``Float8LinearConfig``: the weight is cast to its weight cast's float8 dtype.
        """
        records = weight_records(model) if modules else {}
        if modules and not records:
            self.note = "the model has no FSDP2-sharded parameter: nothing is gathered"
            return
        for name, module in modules.items():
            module = model.get_submodule(name) if module is None else module
            if name in self._held:
                continue
            fsdp_param, owner = records.get(id(module), (None, None))
            why = self._refusal(fsdp_param)
            if why or owner is None:
                self.skipped[name] = why
                continue
            self._wrap(name, module, fsdp_param, owner, mm_config, config.cast_config_weight.target_dtype)

    @staticmethod
    def _refusal(fsdp_param: Any) -> str:
        if fsdp_param is None:
            return "not an FSDP2-sharded parameter"
        weight = fsdp_param.sharded_param
        if weight.device_mesh.ndim != 1:
            return "sharded on a mesh of more than one dimension"
        if weight.shape[0] % weight.device_mesh.size():
            return f"{weight.shape[0]} rows do not shard evenly over {weight.device_mesh.size()} ranks"
        post_forward = getattr(fsdp_param, "post_forward_mesh_info", None)
        if post_forward is not None and post_forward != fsdp_param.mesh_info:
            # FSDP2 raises NotImplementedError gathering an extension's tensor from such a post-forward shard
            return "resharded after forward to a smaller group (reshard_after_forward=<int>)"
        if not gathers_extensions(fsdp_param):
            return f"torch {torch.__version__}'s FSDP2 has no all-gather extensions"
        return ""

    def _wrap(self, name: str, module: nn.Module, fsdp_param: Any, owner: nn.Module, mm_config: Any,
              dtype: torch.dtype) -> None:
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        owner.reshard()  # type: ignore[operator]  # a root keeps its gathered parameters after a forward alone
        wrapped: Any = WeightWithDynamicFloat8CastTensor(local_shard(fsdp_param), mm_config, dtype)
        wrapped.fsdp_pre_all_gather = _standing_aside(wrapped.fsdp_pre_all_gather)
        plain_local, plain_data = swap_local_shard(fsdp_param, wrapped)
        hook = module.register_state_dict_post_hook(_plain_state())
        self._held[name] = _Held(fsdp_param, owner, plain_local, plain_data, hook)
        if name not in self.gathered:  # set aside for a measurement and installed again
            self.gathered.append(name)

    def precompute_scales(self) -> None:
        """Every gathered weight's float8 scale from one all-reduce, before a step's first all-gather.

        Without it each all-gather of a weight (forward, and again for backward) runs its own amax all-reduce: two
        tiny collectives per weight and step. The scale is the one each gather would compute (the same amax, as
        torchao's ``precompute_float8_dynamic_scale_for_fsdp`` computes it), so the run does not change. Called on
        every rank at a batch's start. An optimizer step (see :meth:`watch`) drops the scales: until the next call
        each gather computes its own again (a validation loop, a forward after ``step`` in a manual step), as does a
        weight installed since.
        """
        if not self._held:
            return
        from torchao.float8.float8_utils import EPS

        wrapped: list[Any] = [held.fsdp_param.sharded_param for held in self._held.values()]
        with torch.no_grad(), SUSPENDED.scope(), autocast_off():
            # the inf-norm of each DTensor is a partial max: the clamp on their stack reduces them all at once
            amax: Any = torch.clamp(torch.stack(foreach_norm(wrapped, math.inf)), EPS).to(torch.float64)
            dtype = float8_dtype(local_shard(next(iter(self._held.values())).fsdp_param))  # the recipe's one dtype
            scales = (torch.finfo(dtype).max / amax).to_local().to(torch.float32)
        for held, scale in zip(self._held.values(), scales):
            set_scale(local_shard(held.fsdp_param), scale)

    def watch(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Drop the precomputed scales whenever one of ``optimizers`` has stepped: the weights changed.

        An optimizer that changes the weights between the closure calls of one step (LBFGS) runs its later calls
        with the scales of the batch's start: a weight grown past its amax there saturates in float8.

        Args:
            optimizers: the fit's optimizers (the hooks go at :meth:`restore`).
        """
        for optimizer in optimizers:
            # after the step, not before: Lightning runs the step's forward and backward inside ``step(closure)``
            self._step_hooks.append(optimizer.register_step_post_hook(lambda *args: self._drop_scales()))

    def _drop_scales(self) -> None:
        for held in self._held.values():
            set_scale(local_shard(held.fsdp_param), None)

    def release(self, name: str, forget: bool = True) -> bool:
        """Gather module ``name``'s weight in its usual dtype again; whether it was gathered in float8.

        Args:
            name: the module's path.
            forget: drop it from :attr:`gathered` too (a repair's pin; teardown keeps the record).
        """
        held = self._held.pop(name, None)
        if held is None:
            return False
        if forget:
            self.gathered.remove(name)
        fsdp_param = held.fsdp_param
        held.owner.reshard()  # type: ignore[operator]
        swap_local_shard(fsdp_param, held.plain_local, held.plain_data)
        held.hook.remove()
        return True

    def restore(self) -> None:
        """Every weight gathered in its usual dtype again, no optimizer watched (teardown, an exception)."""
        for hook in self._step_hooks:
            hook.remove()
        self._step_hooks.clear()
        for name in list(self._held):
            self.release(name, forget=False)

    def reset(self) -> None:
        """Restore, and forget what ran and what was left out."""
        self.restore()
        self.gathered.clear()
        self.skipped.clear()
        self.note = ""


def gather_lines(gather: Float8AllGather) -> list[str]:
    """The run summary's lines on ``fp8_all_gather``: what FSDP2 gathered in float8, what it could not and why.

    Example:
        >>> gather = Float8AllGather()
        >>> gather.install(nn.Sequential(nn.Linear(16, 16)), {"0": None}, None, None)
        >>> gather_lines(gather)
        ['  fp8: fp8_all_gather: the model has no FSDP2-sharded parameter: nothing is gathered']
    """
    lines = [f"  fp8: fp8_all_gather: {gather.note}"] if gather.note else []
    if gather.gathered:
        lines.append(f"  fp8: {len(gather.gathered)} weight(s) gathered by FSDP2 in float8 (torchao's all-gather)")
    if gather.skipped:
        lines.append(f"  fp8: weights gathered in their own dtype: {named_reasons(gather.skipped)}")
    return lines
