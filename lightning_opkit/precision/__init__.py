"""Per-operator-class mixed precision: the policy (a callback), measurement, decision and census.

- :mod:`~lightning_opkit.precision.policy`: :class:`PrecisionPolicy`, the Lightning callback.
- :mod:`~lightning_opkit.precision.measure`: :func:`measure_precision`, speed and error per class on this device.
- :mod:`~lightning_opkit.precision.decide`: :func:`decide`, the dtype per class from measurements.
- :mod:`~lightning_opkit.precision.census`: what ran in which dtype and what it cost, per class.
"""

from lightning_opkit.precision.decide import DEFAULT_TOLERANCE, Decision, decide
from lightning_opkit.precision.measure import measure_precision
from lightning_opkit.precision.policy import DEFAULT_RULES, PrecisionPolicy
from lightning_opkit.precision.results import Measurement, PrecisionMeasurements

__all__ = ["DEFAULT_RULES", "DEFAULT_TOLERANCE", "Decision", "Measurement", "PrecisionMeasurements",
           "PrecisionPolicy", "decide", "measure_precision"]
