"""How an opkit callback finds the others on its Trainer: by what they offer, never by their class or name.

Each offer is a small protocol; a callback offers it by having its members. Nothing here imports a feature package, so
any callback can ask for any offer without importing the callback that makes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
from torch import nn

__all__ = ["CompilesRegions", "HearsOfFailure", "Member", "PinsModules", "RunsModulesInDtype", "members", "offering"]


@runtime_checkable
class Member(Protocol):
    """Every opkit callback: it contributes lines to the run summary and charts to the custom-scalars layout."""

    def summary_lines(self) -> list[str]:
        """Its lines of the run summary."""
        ...

    def layout(self) -> dict[str, dict[str, list[Any]]]:
        """Its part of TensorBoard's custom-scalars layout: category -> chart title -> ``["Multiline", [regexes]]``."""
        ...


@runtime_checkable
class RunsModulesInDtype(Protocol):
    """Runs a module (or the whole step) in a dtype on request: a NaN cause replay's fp32 region goes through it."""

    def running_in(self, module: nn.Module | None, dtype: Any) -> Any:
        """A context inside which every op of ``module`` (``None``: the whole step) runs in ``dtype``."""
        ...


@runtime_checkable
class PinsModules(Protocol):
    """Runs a module in a dtype from now on, on request: a NaN repair pins its culprit to fp32 through it."""

    def pin(self, name: str, module: nn.Module, dtype: str) -> None:
        """Every op inside ``module`` (at path ``name``) runs in ``dtype`` from now on, until teardown."""
        ...


@runtime_checkable
class HearsOfFailure(Protocol):
    """Told what ended a fit by an exception, on every rank, before any callback writes the run summary."""

    def ended_by(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """``trainer``'s fit failed with ``exception`` (heard once per opkit callback: it must be idempotent)."""
        ...


@runtime_checkable
class CompilesRegions(Protocol):
    """Compiles parts of the model (``compiled`` holds their paths): each table a policy tries would recompile.

    ``backend`` names the ``torch.compile`` backend (``"inductor"``, ``"eager"``, ...).
    """

    compiled: list[str]
    backend: str


def members(trainer: pl.Trainer) -> list[Member]:
    """The opkit callbacks of ``trainer`` that are on, in its order (the first writes what is written once per run).

    Example:
        >>> members(pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False))
        []
    """
    return [c for c in trainer.callbacks  # type: ignore[attr-defined]
            if isinstance(c, Member) and getattr(c, "enabled", True)]  # one that is off is no member


def offering(trainer: pl.Trainer, offer: type[Any]) -> Iterator[Any]:
    """The opkit callbacks of ``trainer`` that make ``offer`` (one of this module's protocols).

    Args:
        trainer: the trainer.
        offer: the protocol.

    Example:
        >>> trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
        >>> list(offering(trainer, CompilesRegions))
        []
    """
    return (c for c in members(trainer) if isinstance(c, offer))
