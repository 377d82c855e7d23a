"""Private names of Lightning and torchmetrics that opkit reads, each behind one name here.

A re-run of the user's step (:mod:`.replay`) must hold what Lightning and torchmetrics would otherwise change: the
optimizer wrappers Lightning hands ``training_step``, and a metric's states. Neither has a public accessor on the
supported releases; a release that moves one is mended in this file (``tests/core/test_lightning_compat.py`` uses
each on the running release). A callback's ``state_key`` built with Lightning's ``Callback._generate_state_key`` is
the one protected name used elsewhere: Lightning documents it for subclasses.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torchmetrics import Metric

__all__ = ["attached_trainer", "metric_state_names", "wrapped_optimizers"]


def attached_trainer(pl_module: Any) -> pl.Trainer | None:
    """The Trainer a LightningModule is attached to, or ``None`` (``pl_module.trainer`` raises when there is none).

    Example:
        >>> attached_trainer(pl.LightningModule()) is None
        True
    """
    return getattr(pl_module, "_trainer", None)


def wrapped_optimizers(trainer: pl.Trainer) -> list[Any]:
    """The ``LightningOptimizer`` wrappers ``self.optimizers()`` hands a manually optimized ``training_step``."""
    return list(trainer.strategy._lightning_optimizers)


def metric_state_names(metric: Metric) -> list[str]:
    """The names of the states a torchmetrics ``Metric`` registered with ``add_state`` (what its ``update`` changes).

    Example:
        >>> from torchmetrics.aggregation import SumMetric
        >>> metric_state_names(SumMetric())
        ['sum_value']
    """
    return list(metric._defaults)
