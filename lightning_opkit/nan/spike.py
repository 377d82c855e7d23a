"""Loss and gradient-norm spikes: robust z-scores against the recent good steps, computed on the device.

A step is a spike when its loss (or its global gradient norm) is more than ``zscore`` deviations above the recent
good steps. The statistic is the median and the median absolute deviation (MAD, times 1.4826: the standard deviation
of a normal sample) of the last ``window`` good steps, in log space:

- log space, because a loss falls over orders of magnitude and a spike is a ratio (x30), not a difference; the loss
  through ``sign(x) * log1p(|x|)``, which is the log for large losses and stays defined for small or negative ones;
  the gradient norm through ``log``;
- median and MAD, because they are not moved by the outliers they are there to catch, and a loss still falling sits
  below its recent median (a negative score) instead of alarming;
- a floor of 0.1 in log space under the deviation (about 10%), because a loss that has converged moves by almost
  nothing, and a few percent up would otherwise score in the thousands;
- a warm-up of ``min(window, 20)`` good steps before any step is judged;
- only good steps enter the window: a spike, a skipped or non-finite step never does.

Everything lives on the device: the window is a ring buffer written in place, the score is a few small reductions,
and it travels to the host with the check's flags, in the same one sync.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["FLOOR", "SpikeWatch", "log_loss"]

#: the deviation's floor, in log space
FLOOR = 0.1
_WARMUP = 20


def log_loss(loss: Tensor) -> Tensor:
    """``sign(x) * log1p(|x|)``: the log of a large loss, defined for a small or negative one.

    Example:
        >>> log_loss(torch.tensor([0.0, -1.0, 8.7])).tolist()
        [0.0, -0.6931471824645996, 2.2721259593963623]
    """
    return loss.sign() * loss.abs().log1p()


class SpikeWatch:
    """The recent good steps' log-loss and log-gradient-norm, and the scores of a new step against them.

    Args:
        window: good steps kept.
        device: where the window lives (the training device).

    Example:
        >>> watch = SpikeWatch(window=30, device=torch.device("cpu"))
        >>> for i in range(25):
        ...     watch.record(torch.tensor([log_loss(torch.tensor(1.0 + 0.01 * (i % 3))), 0.0]))
        >>> z = watch.scores(torch.stack([log_loss(torch.tensor(8.7)), torch.tensor(0.0)]))
        >>> bool(z[0] > 6), float(z[1])
        (True, 0.0)
    """

    def __init__(self, window: int, device: torch.device) -> None:
        self.window = window
        self.warmup = min(window, _WARMUP)
        self.values = torch.zeros(window, 2, device=device)
        self.count = 0

    @property
    def ready(self) -> bool:
        """Whether enough good steps were seen to judge one."""
        return self.count >= self.warmup

    def scores(self, values: Tensor) -> Tensor:
        """The z-scores of ``values`` (log-loss, log-gradient-norm), 0 for each while warming up (no sync).

        Args:
            values: a 2-element tensor on the window's device.
        """
        if not self.ready:
            return torch.zeros_like(values)
        seen = self.values[: min(self.count, self.window)]
        median = seen.median(dim=0).values
        mad = (seen - median).abs().median(dim=0).values
        return (values - median) / (1.4826 * mad + FLOOR)

    def record(self, values: Tensor) -> None:
        """A good step's values enter the window (in place, no sync)."""
        self.values[self.count % self.window].copy_(values)
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        """The window, for a checkpoint (a resumed run goes on judging against it)."""
        return {"values": self.values.detach().cpu().tolist(), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back from :meth:`state_dict`."""
        values = torch.tensor(state.get("values", []), dtype=self.values.dtype)
        if values.shape == self.values.shape:
            self.values.copy_(values)
            self.count = int(state.get("count", 0))
