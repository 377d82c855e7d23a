"""Periodic profiler windows: :class:`ProfilerWindows` over Trainer-free parts.

- :mod:`.windows`: :class:`ProfilerWindows`, the Lightning callback (when a window opens, what it reports).
- :mod:`.session`: one window: the schedule (a pure function) and torch.profiler opened, stepped and released.
- :mod:`.op_times`: a finished window as time per op class (on the device's timeline on a GPU), top ops, memory.
- :mod:`.log`: what a window writes: scalars, its note, the ``top_ops`` and ``op_classes`` tables.
- :mod:`.roofline`: work per op class against this device's measured peaks (``roofline=True``).
"""

from lightning_opkit.profiler.session import window_phase
from lightning_opkit.profiler.windows import ProfilerWindows

__all__ = ["ProfilerWindows", "window_phase"]
