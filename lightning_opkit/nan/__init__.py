"""Numerics faults: :class:`NaNDetector` over Trainer-free parts.

How a checked step goes, file by file:

- :mod:`.check`: the one cheap check per step (the loss and every gradient, one fused reduction, one host sync).
- :mod:`.skip`: what happens on a skipped step (weights, optimizer state, LR schedule and buffers untouched).
- :mod:`.device`: ``decide="device"``: the skip decided on the device by a fused optimizer, the flags read a step late.
- :mod:`.replays`: the slow path, only after a failed check: the replays that find the origin and cause; the report.
- :mod:`.locate`: the replay with per-module hooks that names where the first non-finite value came from.
- :mod:`.cause`: the replays that tell precision from data or model faults from transient ones.
- :mod:`.report`: the typed report (:class:`~.report.NaNReport`), its dict view and :class:`NonFiniteError`.
- :mod:`.actions`: what is done about the report: the repair (:mod:`.repair`), the counters, what :mod:`.log` writes,
  then raise, skip, warn or stop.
- :mod:`.detector`: :class:`NaNDetector`, the Lightning callback that hands each hook to them in that order, and
  to the watches beside the check: :mod:`.spike` and :mod:`.spike_report` (loss and gradient spikes), :mod:`.dead`
  (parameters without a gradient), :mod:`.scaler` (a GradScaler's collapse).
"""

from lightning_opkit.nan.detector import NaNDetector
from lightning_opkit.nan.report import NonFiniteError, format_report

__all__ = ["NaNDetector", "NonFiniteError", "format_report"]
