"""Per-operator-class mixed precision: the policy (a callback), measurement, decision and census.

How a step runs:

- :mod:`.policy`: :class:`PrecisionPolicy`, the Lightning callback; :mod:`.config` checks its arguments and builds
  the starting table (op class -> dtype).
- :mod:`.in_force`: the decision in force (the table, the plan it came from, module overrides, float8 modules and
  pins), installed on the model and read by every report and the checkpoint; :mod:`.plan` is a decision as a value.
- :mod:`.schedule`: when the policy measures (the first batch, every N steps, a checkpoint's plan instead).
- :mod:`.governor`: wraps each step method; a step runs under the policy's mode, under plain autocast (when auto
  chose it, or the table is exactly what autocast does), or as written (fp32 everywhere on an fp32 model).
- :mod:`.function_mode`: the ``TorchFunctionMode`` that casts each op's inputs to its class's (or its module's)
  dtype; :mod:`.dtypes` names the dtypes and what the hardware offers.
- :mod:`.census`: on census steps, what ran in which dtype, its error against fp32 recomputes, underflow, headroom;
  :mod:`.view` shows it (TensorBoard, the run summary).

How ``rules="auto"`` decides (:mod:`.auto` runs these in order, every rank taking rank zero's decision):

1. :mod:`.measure`: :func:`measure_precision` records the ops of a real step (:mod:`.oplog`), times each class in
   fp32 and 16-bit at those shapes (:mod:`.op_timing`) and, per class, the error of lowering it alone
   (:mod:`.runner`); :mod:`.results` holds the measurements.
2. :mod:`.decide`: :func:`decide` picks per class the fastest 16-bit dtype that is faster and within tolerance.
3. :mod:`.candidates`: whole-step candidate tables (and plain autocast) run on the first rows of the batch, for their
   time and error as a whole; the fastest within tolerance is chosen.
4. the close contenders confirmed on the next real training steps (a :class:`~lightning_opkit.core.trial.Trial`),
   the fastest kept.
5. :mod:`.fp8_measure`: where float8 GEMMs can be fast, each Linear timed at its rows in float8 against its class's
   dtype, its error measured alone and with the others; those faster and within tolerance run in float8 (:mod:`.fp8`).

With explicit rules, :mod:`.speed_check` times the lowered classes once and warns where 16-bit is slower.
"""

from lightning_opkit.precision.decide import DEFAULT_TOLERANCE, Decision, decide
from lightning_opkit.precision.measure import measure_precision
from lightning_opkit.precision.policy import DEFAULT_RULES, PrecisionPolicy
from lightning_opkit.precision.results import Measurement, PrecisionMeasurements

__all__ = ["DEFAULT_RULES", "DEFAULT_TOLERANCE", "Decision", "Measurement", "PrecisionMeasurements",
           "PrecisionPolicy", "decide", "measure_precision"]
