"""Time on the device's clock: a synchronization that is a no-op off CUDA, and N back-to-back calls timed.

On a GPU, one op between two host synchronizations measures launch latency and the sync itself, not the kernel.
Calls are timed back to back between two CUDA events instead, so the queue stays full and the figure is the device's
time per call; on a CPU, between two reads of the host clock.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["StepClock", "at_shapes", "best_seconds", "count_weighted_ratio", "filled_seconds", "per_call_seconds",
           "sync"]


def sync(device: torch.device | str | None = None) -> None:
    """Wait for ``device``'s queued work (CUDA only; nothing elsewhere, and nothing before CUDA is initialized).

    Args:
        device: the device; ``None``: the current CUDA device, if CUDA is in use.

    Example:
        >>> sync("cpu")
    """
    if device is not None and torch.device(device).type != "cuda":
        return
    if torch.cuda.is_initialized():
        torch.cuda.synchronize(device)


def per_call_seconds(fn: Callable[[], Any], device: torch.device | str, calls: int = 1) -> float:
    """Seconds per call of ``fn``, over ``calls`` calls made back to back.

    On CUDA the calls run between two CUDA events on the current stream (one synchronization at the end); elsewhere
    between two reads of the host clock.

    Args:
        fn: what to time (its results are dropped).
        device: where it runs.
        calls: how many calls in a row.

    Example:
        >>> per_call_seconds(lambda: torch.ones(8) @ torch.ones(8), "cpu", calls=3) > 0
        True
    """
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) / calls


def best_seconds(fn: Callable[[], Any], device: torch.device | str, reps: int = 3, calls: int = 1) -> float:
    """The fastest of ``reps`` samples of :func:`per_call_seconds`, after one warm-up call.

    Args:
        fn: what to time.
        device: where it runs.
        reps: samples taken.
        calls: back-to-back calls per sample.

    Example:
        >>> best_seconds(lambda: torch.ones(64, 64) @ torch.ones(64, 64), "cpu", reps=2) > 0
        True
    """
    fn()
    sync(device)
    best = math.inf
    for _ in range(reps):
        best = min(best, per_call_seconds(fn, device, calls))
    return best


def filled_seconds(fn: Callable[[], Any], device: torch.device | str, fill_s: float) -> float:
    """Seconds per call of ``fn``: one call timed, then the best of 3 samples of as many calls as fill ``fill_s``.

    Back-to-back calls keep a GPU's queue full, so a short op is not timed by its launch (at most 20 calls a sample).

    Args:
        fn: what to time.
        device: where it runs.
        fill_s: about how long a sample should take.

    Example:
        >>> filled_seconds(lambda: torch.ones(64, 64) @ torch.ones(64, 64), "cpu", fill_s=1e-3) > 0
        True
    """
    one = best_seconds(fn, device, reps=1)
    calls = max(1, min(20, int(fill_s / max(one, 1e-7))))
    return min(one, best_seconds(fn, device, reps=3, calls=calls))


#: what :func:`at_shapes` measured, by its key: a model's shapes rarely change within a run, so the same op at the same
#: shapes (a re-measurement, a later window) is timed once a process
_AT_SHAPES: dict[tuple[Any, ...], dict[str, float]] = {}


def at_shapes(key: tuple[Any, ...], variants: dict[str, Callable[[], Any]], device: torch.device | str,
              reps: int = 3, fill_s: float = 1e-3, give_up: float | None = None) -> dict[str, float]:
    """Seconds per call of each variant of one op or module at one run's shapes: the kit's one such timer.

    Each variant is called twice (warm-up: allocator, kernel choice, lazy init; then once timed); then ``reps`` rounds
    sample every variant in turn (A B C, A B C: drift hits them alike), each sample as many calls back to back as fill
    ``fill_s`` (at most 20, fixed by the slowest variant's call), and each variant's median is kept. The result is
    cached under ``key`` (with the device and the variants' names) for the life of the process.

    Args:
        key: what is timed, at which shapes (hashable).
        variants: name -> a call of the op or module in that variant (a dtype, a layout); the first is the baseline.
        device: where it runs.
        reps: samples per variant.
        fill_s: about how long a sample should take.
        give_up: a variant this many times slower than the baseline after its first sample is not sampled again.

    Example:
        >>> a = torch.ones(64, 64)
        >>> sorted(at_shapes(("mm", (64, 64)), {"fp32": lambda: a @ a, "bf16": lambda: a.bfloat16() @ a.bfloat16()},
        ...                  "cpu", reps=2))
        ['bf16', 'fp32']
    """
    cache_key = (str(device), *key, tuple(variants))
    if cache_key in _AT_SHAPES:
        return _AT_SHAPES[cache_key]
    for fn in variants.values():
        fn()
    sync(device)
    base = next(iter(variants))
    # calls per sample from the slowest variant's one call after its warm-up: a variant 1000x slower (float8 emulated
    # on a CPU) is not called 20 times a sample because the baseline is fast. Not from the warm-up itself: a first
    # call's lazy init (cuBLAS, Inductor, torchao imports) would leave a fast op one call per sample, which on a GPU
    # times its launch, not its kernel
    slowest = max(per_call_seconds(fn, device) for fn in variants.values())
    calls = max(1, min(20, int(fill_s / max(slowest, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps):
        for name, fn in variants.items():
            if rep and give_up is not None and name != base and samples[name][0] > give_up * samples[base][0]:
                continue  # clearly slower after one sample: more would not change the verdict
            samples[name].append(per_call_seconds(fn, device, calls))
    _AT_SHAPES[cache_key] = {name: statistics.median(values) for name, values in samples.items()}
    return _AT_SHAPES[cache_key]


def count_weighted_ratio(timed: Iterable[tuple[int, tuple[float, float] | None, str]],
                         ) -> tuple[float, list[str]] | None:
    """The second variant's time over the first's across a run's shapes, each weighted by how often it ran.

    Args:
        timed: per shape, its calls in the run, :func:`at_shapes`' ``(first, second)`` seconds (``None``: not timed)
            and its words for the report; taken lazily, so a shape is timed only when reached.

    Returns:
        The ratio and the words of the shapes that timed, or ``None`` where none did.

    Example:
        >>> count_weighted_ratio([(2, (1.0, 3.0), "a"), (1, None, "b"), (1, (2.0, 2.0), "c")])
        (2.0, ['a', 'c'])
    """
    first = second = 0.0
    words = []
    for count, pair, word in timed:
        if pair is None or not math.isfinite(pair[0] * pair[1]):
            continue
        first += count * pair[0]
        second += count * pair[1]
        words.append(word)
    return (second / first, words) if words and first > 0 else None


class StepClock:
    """Step times on the device's clock, taken without a host synchronization.

    On CUDA a step is two events recorded in the stream; its time is read later, once both have completed
    (:meth:`seconds`), so a step never waits for the GPU to be timed. Elsewhere, the host clock.

    Example:
        >>> clock = StepClock()
        >>> clock.start("cpu")
        >>> clock.stop(keep=True)
        >>> len(clock.seconds())
        1
    """

    def __init__(self) -> None:
        self._open: Any = None
        self._pending: list[tuple[Any, Any]] = []
        self._done: list[float] = []

    def start(self, device: torch.device | str) -> None:
        """A step begins on ``device``."""
        if (device if isinstance(device, torch.device) else torch.device(device)).type == "cuda":
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self, keep: bool) -> None:
        """The step ends; ``keep`` it among the step times, or drop it (a step that compiled, say)."""
        began, self._open = self._open, None
        if began is None or not keep:
            return
        if isinstance(began, float):
            self._done.append(time.perf_counter() - began)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((began, end))

    def seconds(self, wait: bool = False) -> list[float]:
        """Every kept step's time so far, oldest first (on CUDA those whose events completed; all with ``wait``)."""
        while self._pending and (wait or self._pending[0][1].query()):
            began, end = self._pending.pop(0)
            end.synchronize()
            self._done.append(began.elapsed_time(end) / 1e3)
        return self._done
