"""Numerics faults: :class:`NaNDetector` over Trainer-free parts.

How a checked step goes, file by file:

- :mod:`.check`: the one cheap check per step (the loss and every gradient, one multi-tensor pass, one host sync).
- :mod:`.device`: ``decide="device"``: the skip decided on the device by a fused optimizer, the flags read a step late.
- :mod:`.replays`: the slow path, only after a failed check: the replay with per-module hooks that names where the
  first non-finite value came from, then the cause ladder (precision, data or model, transient); the report.
- :mod:`.report`: the typed report (:class:`~.report.NaNReport`), its dict view and :class:`NonFiniteError`, and what
  it writes to the loggers.
- :mod:`.actions`: what is done about the report: the repair (:mod:`.repair`), the counters, then raise, skip (what
  happens on a skipped step: weights, optimizer state, LR schedule and buffers untouched), warn or stop.
- :mod:`.detector`: :class:`NaNDetector`, the Lightning callback that hands each hook to them in that order, and
  to the watches beside the check: :mod:`.spike` and :mod:`.spike_report` (loss and gradient spikes), :mod:`.dead`
  (parameters without a gradient), :mod:`.scaler` (a GradScaler's collapse).
"""

from lightning_opkit.nan.detector import NaNDetector
from lightning_opkit.nan.report import NonFiniteError, format_report

__all__ = ["NaNDetector", "NonFiniteError", "format_report"]
