"""Loss and gradient-norm spikes: robust z-scores of each step against the recent good steps.

A step is a spike when its loss (or its global gradient norm) is more than ``zscore`` deviations above the recent
good steps. In log space, against the last ``window`` good steps:

- the level is the median of the last 10 good steps: it follows a loss that is still falling, where a median over
  the whole window would sit far above it;
- the deviation is the step-to-step noise: the median absolute deviation (MAD) of successive differences, times
  1.4826 (the standard deviation of a normal sample) over sqrt(2) (a difference has two steps' noise). The trend of
  a falling loss makes every difference alike, so it does not inflate the deviation as the spread of the values
  themselves would (a run's first, steep steps would make any later spike look small);
- median and MAD, because they are not moved by the outliers they are there to catch;
- log space, because a loss falls over orders of magnitude and a spike is a ratio, not a difference; the loss
  through ``sign(x) * log1p(|x|)``, which is the log for large losses and stays defined for small or negative ones
  (so a loss below about 0.1 counts by its absolute rise);
- a floor under the deviation, 0.1 in log space for the loss (about 10%) and 0.25 for the gradient norm (about
  30%), because a loss that has converged moves by almost nothing, and a few percent up would otherwise score in
  the thousands; a batch's gradient norm varies far more than its loss, healthy or not;
- a warm-up of ``min(window, 20)`` good steps before any step is judged;
- only good steps enter the window: a spike, a skipped or non-finite step never does.

The loss and the gradient norm reach the host in the check's one sync, reduced over ranks by the same collective as
the flags (their maximum: the worst rank's loss, and under DDP the one gradient norm; the log is monotone, so the
maximum's log is the logs' maximum), so every rank keeps the same window and takes the same decision; their logs and
the statistics over a hundred pairs of floats are then computed on the host, with no device work at all (measured
cheaper on a CPU than a dozen small tensor ops).
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lightning_opkit.core.patch import Patches
from lightning_opkit.core.ranks import local_floats
from lightning_opkit.core.replay import run_step, set_rng_state

__all__ = ["DEPARTS", "FLOOR", "SpikeWatch", "departures"]

#: a module's outputs depart from the good batch's when their RMS differs by this factor, either way
DEPARTS = 4.0

#: the deviation's floor in log space: the loss's, the gradient norm's (a batch's gradient norm varies by tens of
#: percent where its loss varies by a few: with 0.1, healthy zoo runs at a high learning rate alarmed on it)
FLOOR = (0.1, 0.25)
_WARMUP = 20
_RECENT = 10


class SpikeWatch:
    """The recent good steps' log-loss and log-gradient-norm, and the scores of a new step against them (host side).

    Args:
        window: good steps kept.

    Example:
        >>> watch = SpikeWatch(window=30)
        >>> for i in range(25):
        ...     watch.record((math.log1p(1.0 + 0.01 * (i % 3)), 0.0))
        >>> loss_z, grad_z = watch.scores((math.log1p(8.7), 0.0))
        >>> loss_z > 6, grad_z
        (True, 0.0)
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.warmup = min(window, _WARMUP)
        self.values: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self.count = 0

    @property
    def ready(self) -> bool:
        """Whether enough good steps were seen to judge one."""
        return self.count >= self.warmup

    def scores(self, values: tuple[float, float]) -> tuple[float, float]:
        """The z-scores of ``values`` (log-loss, log-gradient-norm); 0 for each while warming up, or not finite."""
        if not self.ready or len(self.values) < 2:
            return 0.0, 0.0
        out = []
        for i, floor in enumerate(FLOOR):
            seen = [v[i] for v in self.values]
            level = statistics.median(seen[-_RECENT:])
            steps = [b - a for a, b in zip(seen, seen[1:])]
            middle = statistics.median(steps)
            mad = statistics.median(abs(d - middle) for d in steps)
            z = (values[i] - level) / (1.4826 / math.sqrt(2) * mad + floor)
            out.append(z if math.isfinite(z) else 0.0)
        return out[0], out[1]

    def record(self, values: tuple[float, float]) -> None:
        """A good step's values enter the window."""
        self.values.append((float(values[0]), float(values[1])))
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        """The window, for a checkpoint (a resumed run goes on judging against it)."""
        return {"values": [list(v) for v in self.values], "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back from :meth:`state_dict`."""
        self.values.clear()
        for v in state.get("values", [])[-self.window:]:
            self.values.append((float(v[0]), float(v[1])))
        self.count = int(state.get("count", len(self.values)))


def _rms(model: nn.Module, compute_loss: Callable[[], Tensor | None], rng: Any,
         modules: list[tuple[str, nn.Module]]) -> list[tuple[str, float]]:
    """Each module's output RMS in a forward replay of one micro-batch, in call order."""
    seen: list[tuple[str, float]] = []
    patches = Patches()

    def hook(path: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            outs = local_floats(output)
            if outs:
                square = sum(float(t.detach().float().square().sum()) for t in outs)
                seen.append((path, math.sqrt(square / max(sum(t.numel() for t in outs), 1))))

        return record

    for path, module in modules:
        if path:
            patches.hold(module.register_forward_hook(hook(path)))
    set_rng_state(rng)
    try:
        run_step(model, compute_loss, backward=False)
    finally:
        patches.restore()
    return seen


def departures(model: nn.Module, spiked: tuple[Callable[[], Tensor | None], Any],
               good: tuple[Callable[[], Tensor | None], Any],
               modules: list[tuple[str, nn.Module]]) -> list[tuple[str, float]]:
    """Each module's output RMS on the spiked micro-batch over the last good one's, in forward order.

    Both replays run on the same (current) weights, each from its own RNG state, forward only; buffers and metrics
    are put back after each. A module called more than once is compared call by call.

    Args:
        model: the root module.
        spiked: the spiked micro-batch's loss function and RNG state.
        good: the last good micro-batch's.
        modules: ``(path, module)`` pairs to watch.

    Returns:
        ``(path, ratio)`` per module call, in the spiked replay's call order.

    Example:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> net = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 1))
        >>> x, rng = torch.ones(2, 4), torch.get_rng_state()
        >>> ratios = departures(net, (lambda: net(30 * x).sum(), (rng, None)), (lambda: net(x).sum(), (rng, None)),
        ...                     list(net.named_modules()))
        >>> [path for path, r in ratios if abs(math.log(r)) > math.log(DEPARTS)][:1]
        ['0']
    """
    first = _rms(model, *spiked, modules)
    second = _rms(model, *good, modules)
    calls: dict[str, list[float]] = {}
    for path, rms in second:
        calls.setdefault(path, []).append(rms)
    out, used = [], dict.fromkeys(calls, 0)
    for path, rms in first:
        if used.get(path, 0) < len(calls.get(path, [])):
            out.append((path, rms / max(calls[path][used[path]], 1e-30)))
            used[path] += 1
    return out
