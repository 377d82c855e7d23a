"""One profiler window, Trainer-free: the schedule (one pure function), opening, stepping and closing torch.profiler."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_opkit.core.timing import sync

__all__ = ["SETTLE", "Window", "ends_recording", "opens_window", "settle_collectives", "settler", "window_phase"]

#: the span around :func:`settle_collectives`; a window's analysis reads the events that began before it
SETTLE = "opkit::settle_collectives"


def window_phase(batch: int, every_n_steps: int, warmup: int, active: int) -> tuple[int, str]:
    """Where training batch ``batch`` (0-based) falls in the window schedule: ``(window index, phase)``.

    Windows open at batches ``every_n_steps``, ``2 * every_n_steps``, ... (the first ``every_n_steps`` batches,
    with their start-up costs, are never profiled); each runs ``warmup`` unrecorded then ``active`` recorded batches.
    Phases are ``"warmup"``, ``"active"`` or ``"idle"``; the index counts from 0 and is -1 before the first window.
    Everything else (when the callback opens a window, what ``torch.profiler`` records) is read from this function.

    Args:
        batch: the training batch index, counted over the whole run.
        every_n_steps: distance between window starts.
        warmup: batches run under the profiler but not recorded.
        active: recorded batches.

    Example:
        >>> [window_phase(b, 4, 1, 2)[1] for b in range(4, 9)]
        ['warmup', 'active', 'active', 'idle', 'warmup']
    """
    index, offset = divmod(batch, every_n_steps)
    if index == 0:
        return -1, "idle"
    if offset < warmup:
        return index - 1, "warmup"
    if offset < warmup + active:
        return index - 1, "active"
    return index - 1, "idle"


def opens_window(batch: int, every_n_steps: int) -> bool:
    """Whether a window opens at training batch ``batch``: the first batch of a window of :func:`window_phase`.

    Example:
        >>> [b for b in range(10) if opens_window(b, 4)]
        [4, 8]
    """
    index, offset = divmod(batch, every_n_steps)
    return index > 0 and offset == 0


def ends_recording(batch: int, every_n_steps: int, warmup: int, active: int) -> bool:
    """Whether training batch ``batch`` is the last recorded batch of a window of :func:`window_phase`.

    Example:
        >>> [b for b in range(13) if ends_recording(b, 4, 1, 2)]
        [6, 10]
    """
    index, offset = divmod(batch, every_n_steps)
    return index > 0 and offset == warmup + active - 1


def settle_collectives() -> bool:
    """Under gloo, wait until every collective issued so far has closed its profiler record; whether it waited.

    gloo runs a collective on a worker thread, which completes the caller's future and only then ends the
    collective's record: a window stopped right after a step's last all_reduce lost that record now and then (its
    bytes and time, the roofline's communication row, a whole window's under load). gloo's barrier waits for all work
    issued before it, record closed. A collective: every rank calls it at the same batch, profiled or not. NCCL ends
    its records on the calling thread: nothing to wait for there.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and dist.get_backend() == "gloo"):
        return False
    with torch.profiler.record_function(SETTLE):
        dist.barrier()
    return True


def settler(batch: int, every_n_steps: int, warmup: int, active: int) -> Callable[[], bool] | None:
    """:func:`settle_collectives` after a window's last recorded batch (on every rank, profiled or not), else None."""
    return settle_collectives if ends_recording(batch, every_n_steps, warmup, active) else None


def _profiler_schedule(every_n_steps: int, warmup: int, active: int) -> Callable[[int], Any]:
    # torch.profiler counts steps from the window's start; the phases are window_phase's, shifted by one period.
    actions = torch.profiler.ProfilerAction

    def schedule(step: int) -> Any:
        if step >= warmup + active:  # this window is over; with warmup + active == every_n_steps the next would begin
            return actions.NONE
        phase = window_phase(every_n_steps + step, every_n_steps, warmup, active)[1]
        if phase == "warmup":
            return actions.WARMUP
        if phase == "active":
            return actions.RECORD_AND_SAVE if step == warmup + active - 1 else actions.RECORD
        return actions.NONE

    return schedule


@dataclass
class Window:
    """A profiler window: started at construction, stepped once per batch, ``ready`` when its last batch recorded.

    Args:
        every_n_steps: the schedule's period.
        warmup: unrecorded batches.
        active: recorded batches.
        options: ``record_shapes``, ``profile_memory``, ``with_stack``, ``with_flops`` for ``torch.profiler``.
    """

    every_n_steps: int
    warmup: int
    active: int
    options: dict[str, Any]
    prof: Any = None
    step_times: list[float] = field(default_factory=list)
    batch_t0: float | None = None
    ready: bool = False

    def __post_init__(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.reset_peak_memory_stats()

        def ready(_: Any) -> None:
            self.ready = True

        with warnings.catch_warnings(), quiet_stderr():
            warnings.simplefilter("ignore")  # "won't be using warmup" for warmup=0 is what the user asked for
            self.prof = torch.profiler.profile(
                activities=activities, schedule=_profiler_schedule(self.every_n_steps, self.warmup, self.active),
                on_trace_ready=ready, **self.options)
            self.prof.start()

    @property
    def uses_cuda(self) -> bool:
        """Whether the window records CUDA activity."""
        return torch.profiler.ProfilerActivity.CUDA in (self.prof.activities or [])

    def begin_batch(self, phase: str) -> None:
        """Start timing the batch when it is recorded."""
        if phase == "active":
            sync()
            self.batch_t0 = time.perf_counter()

    def end_batch(self, before_stop: Callable[[], Any] | None = None) -> None:
        """Time the batch (if recorded) and step the profiler; the last batch of a window stops it.

        Args:
            before_stop: called after the batch's time is taken, before the profiler steps (still recording).
        """
        if self.batch_t0 is not None:
            sync()
            self.step_times.append(time.perf_counter() - self.batch_t0)
            self.batch_t0 = None
        if before_stop is not None:
            before_stop()
        with warnings.catch_warnings(), quiet_stderr():
            warnings.simplefilter("ignore")
            self.prof.step()

    def stop(self) -> None:
        """Stop the profiler (a window cut short too: torch calls that "RECORD followed by NONE")."""
        with warnings.catch_warnings(), quiet_stderr():
            warnings.simplefilter("ignore")
            self.prof.stop()

    def release(self) -> None:
        """Free the profile now, not at the next full garbage collection."""
        # A finished profile sits in reference cycles (its action map holds its own bound methods), and so do its
        # events (each parent lists its children, each child names its parent): thousands of objects a window, about
        # 1 MB, until the slowest garbage-collector generation runs. Unlinking the event tree and emptying the
        # profile lets reference counting free it all now.
        events = getattr(getattr(self.prof, "profiler", None), "function_events", None) or []
        for event in events:
            event.cpu_parent = None
            event.cpu_children = []
        vars(self.prof).clear()
        self.prof = None


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Inside, file descriptor 2 goes to ``/dev/null``."""
    # Kineto writes "USDT ... profiler_start/stop" lines straight to file descriptor 2 at each window's start and
    # stop, through the progress bar; nothing else is written there in between.
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no usable stderr: nothing to keep quiet
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
