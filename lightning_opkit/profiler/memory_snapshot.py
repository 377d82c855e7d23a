"""Out of memory: telling one apart, and CUDA's allocation history dumped as a snapshot when it happens.

A CUDA snapshot (``torch.cuda.memory._dump_snapshot``) holds every live block with the stack that allocated it and the
recent allocation events; https://pytorch.org/memory_viz opens it. Recording the history costs a little per
allocation, so it is opt-in; there is no such recorder for a CPU.
"""

from __future__ import annotations

import os

import torch

from lightning_opkit.core.torch_compat import dump_memory_snapshot, record_memory_history

__all__ = ["Snapshot", "out_of_memory"]

#: allocation events kept in the history (torch's own default is unbounded; this bounds the host memory it takes)
_EVENTS = 100_000


def out_of_memory(exception: BaseException) -> bool:
    """Whether ``exception`` is an allocation failure: CUDA's, or a CPU allocator's (a ``RuntimeError`` there).

    Example:
        >>> out_of_memory(torch.OutOfMemoryError("CUDA out of memory")), out_of_memory(ValueError("x"))
        (True, False)
    """
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    return isinstance(exception, RuntimeError) and "can't allocate memory" in str(exception)


class Snapshot:
    """CUDA's allocation history, recorded from :meth:`start` and written by :meth:`dump`.

    Example:
        >>> snapshot = Snapshot()
        >>> snapshot.start("cpu"), snapshot.dump("unused.pickle")
        (False, None)
        >>> snapshot.stop()
    """

    def __init__(self) -> None:
        self.recording = False

    def start(self, device: torch.device | str) -> bool:
        """Record allocations on ``device`` from now on; ``False`` where that is not CUDA (nothing recorded)."""
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            return False
        record_memory_history(_EVENTS)
        self.recording = True
        return True

    def dump(self, path: str) -> str | None:
        """Write the snapshot to ``path`` (its folder made); the path, or ``None`` when nothing was recorded."""
        if not self.recording:
            return None
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        dump_memory_snapshot(path)
        return path

    def stop(self) -> None:
        """Stop recording (the history's memory is freed)."""
        if self.recording:
            record_memory_history(None)
            self.recording = False
