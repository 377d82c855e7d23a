"""How an opkit callback finds the others on its Trainer: by what they offer, never by their class or name.

Each offer is a small protocol; a callback offers it by having its members. Nothing here imports a feature package, so
any callback can ask for any offer without importing the callback that makes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
from torch import nn

__all__ = ["CompilesRegions", "HearsOfFailure", "LoadsSteps", "Member", "PinsModules", "RunsModulesInDtype",
           "TimesSteps", "loaded_besides", "measuring_besides", "members", "offering"]


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


@runtime_checkable
class TimesSteps(Protocol):
    """Times alternatives on the fit's own training steps (a :class:`~lightning_opkit.core.trial.Trial`).

    Two such trials at once would time each other: the policy's contender tables on steps with and without
    ActivationCheckpointing's recompute, and the other way round. So one runs at a time: a trial that has not begun
    waits while another member's ``measuring_steps`` is true, and one that has begun goes on.
    """

    @property
    def measuring_steps(self) -> bool:
        """Whether it is timing alternatives on the training steps now (from its first timed step to its verdict)."""
        ...


@runtime_checkable
class LoadsSteps(Protocol):
    """Does extra work on some training steps: a timed trial takes no sample there.

    The policy's census step recomputes every op in fp32.
    """

    def loads_step(self, step: int) -> bool:
        """Whether training step ``step`` (the global step) carries its extra work."""
        ...


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


def loaded_besides(trainer: pl.Trainer, me: Any) -> bool:
    """Whether an opkit callback other than ``me`` does extra work on the step about to run (:class:`LoadsSteps`).

    Example:
        >>> loaded_besides(pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False), None)
        False
    """
    return any(c is not me and c.loads_step(trainer.global_step) for c in offering(trainer, LoadsSteps))


def measuring_besides(trainer: pl.Trainer, me: Any) -> bool:
    """Whether an opkit callback other than ``me`` times alternatives on the training steps now (:class:`TimesSteps`).

    Example:
        >>> measuring_besides(pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False), None)
        False
    """
    return any(c is not me and c.measuring_steps for c in offering(trainer, TimesSteps))
