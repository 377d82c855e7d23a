"""Decisions taken together by every rank: the one helper each slow path goes through across processes.

Under DDP a replay on one rank alone is merely wasted work; under FSDP2 (parameters all-gathered in each forward),
tensor parallelism or a SyncBatchNorm it waits forever for the others. So every replay runs on every rank, and every
decision about what to run next is one rank's, sent to all through these calls. Without a process group they are
the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_opkit.core.torch_compat import tree_leaves
from lightning_opkit.core.torchao_compat import wrapped_in

__all__ = ["Ranks", "local", "local_floats"]


def local(tensor: Any) -> Any:
    """The part of ``tensor`` this rank holds: a DTensor's local shard (FSDP2, tensor parallel), else itself.

    A shard FSDP2 gathers through an all-gather extension that wraps it (``fp8_all_gather``) is the plain shard inside.

    Statistics of a DTensor (``amax``, ``isfinite().all()``) are collectives with partial placements that do not
    mix; opkit's checks and census read the local shard, which costs no communication.

    Example:
        >>> local(torch.ones(2))
        tensor([1., 1.])
    """
    to_local = getattr(tensor, "to_local", None)
    shard = to_local() if callable(to_local) and type(tensor).__name__ == "DTensor" else tensor
    # FSDP2's float8 all-gather (torchao's cast wrapper) wraps the plain shard: its storage and values are that one's.
    # Only a tensor with an all-gather extension can be one: the hot path asks that first.
    if not hasattr(shard, "fsdp_pre_all_gather"):
        return shard
    plain = wrapped_in(shard)
    return shard if plain is None else plain


def local_floats(value: Any) -> list[torch.Tensor]:
    """The non-empty floating tensors anywhere in ``value`` (nested lists, tuples, dicts), in order, by :func:`local`.

    What a check or a census reads of an op's or a module's outputs: each rank judges the shard it holds.

    Example:
        >>> local_floats((torch.ones(2), [torch.arange(3), {"x": torch.zeros(1)}], torch.empty(0)))
        [tensor([1., 1.]), tensor([0.])]
    """
    leaves = (local(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return [t for t in leaves if t.is_floating_point() and t.numel()]


class Ranks:
    """The process group's ranks, or this process alone.

    Args:
        device: where flag tensors go (NCCL reduces CUDA tensors only).

    Example:
        >>> ranks = Ranks(torch.device("cpu"))
        >>> ranks.world, ranks.any(True), ranks.gather("x"), ranks.from_rank("y", 0)
        (1, True, ['x'], 'y')
    """

    def __init__(self, device: torch.device) -> None:
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.world = dist.get_world_size() if self.active else 1
        self.rank = dist.get_rank() if self.active else 0
        self.device = device

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        if not self.active:
            return flag
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def from_rank(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj``, on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
