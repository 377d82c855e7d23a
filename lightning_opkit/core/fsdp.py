"""FSDP2's sharded modules and per-parameter records: the one place opkit reads FSDP2's state.

A replay reshards what its forward gathered; the float8 all-gather swaps a weight's local shard. Both need FSDP2's
modules, and the second its private per-parameter records (``FSDPParam``), which have no public API on any supported
torch: they are read and written here only, so a release that moves them is mended in one file
(``tests/core/test_fsdp.py`` finds each private name on the running torch).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["fsdp_modules", "fully_sharded", "gathers_extensions", "local_shard", "reshard", "swap_local_shard",
           "weight_records"]


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that FSDP2's ``fully_shard`` wrapped (none on a torch without FSDP2).

    Example:
        >>> fsdp_modules(nn.Linear(2, 2))
        []
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fully_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards any part of ``model``.

    Example:
        >>> fully_sharded(nn.Linear(2, 2))
        False
    """
    return bool(fsdp_modules(model))


def reshard(model: nn.Module) -> None:
    """Put FSDP2's parameters back in their shards after a replay (nothing without FSDP2).

    The root (and any module with ``reshard_after_forward=False``) keeps its all-gathered parameters registered
    after a forward until its backward; a forward-only replay has none, and would leave them there.

    Example:
        >>> reshard(nn.Linear(2, 2))  # not sharded: nothing to do
    """
    for module in fsdp_modules(model):
        module.reshard()  # type: ignore[operator]


def weight_records(model: nn.Module) -> dict[int, tuple[Any, nn.Module]]:
    """FSDP2's record of each module's ``weight`` and the ``fully_shard``-ed module holding it, by the module's id.

    The record is FSDP2's private ``FSDPParam``: its ``sharded_param`` (the DTensor the optimizer holds), the local
    shard's storage and the extension hooks an all-gather calls.

    Example:
        >>> weight_records(nn.Linear(2, 2))
        {}
    """
    found: dict[int, tuple[Any, nn.Module]] = {}
    for module in fsdp_modules(model):
        group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        for record in group.fsdp_params if group is not None else ():
            if record._module_info.param_name == "weight":
                found[id(record._module_info.module)] = (record, module)
    return found


def local_shard(record: Any) -> Any:
    """The local shard of a parameter record's DTensor (its ``_local_tensor``: what the optimizer's DTensor holds)."""
    return record.sharded_param._local_tensor


def gathers_extensions(record: Any) -> bool:
    """Whether this torch's FSDP2 gathers a tensor subclass's shard through its all-gather extension hooks."""
    return hasattr(record, "_init_extensions")


def swap_local_shard(record: Any, local: Any, data: Any = None) -> tuple[Any, Any]:
    """Make ``local`` a parameter record's local shard, and have FSDP2 build its gathered tensor anew.

    The parameter object (the optimizer's DTensor) stays; its local shard and FSDP2's view of the shard's storage
    change, and the all-gather buffers built for the old dtype are dropped.

    Args:
        record: FSDP2's ``FSDPParam`` (from :func:`weight_records`).
        local: the new local shard, over the old one's storage (a wrapper subclass) or the old shard itself.
        data: FSDP2's flat view of the shard (``None``: ``local.view(-1)``).

    Returns:
        The old ``(local shard, flat view)``: what a later call puts back.
    """
    old = record.sharded_param._local_tensor, record._sharded_param_data
    record.sharded_param._local_tensor = local
    record._sharded_param_data = local.view(-1) if data is None else data
    record._init_extensions()
    if hasattr(record, "_unsharded_param"):
        record.free_unsharded_param()
        del record._unsharded_param
    record.all_gather_outputs = []
    record._unsharded_inner_tensors = []
    return old
