"""The Lightning strategies the kit runs under, and those it refuses at setup, naming what works instead.

Tested: single device, DDP (``ddp``, and ``ddp_spawn``), and ``ModelParallelStrategy`` (FSDP2, tensor parallel). Two
are refused before anything attaches, by class name so that DeepSpeed need not be installed to be told so.
"""

from __future__ import annotations

import lightning.pytorch as pl

__all__ = ["REFUSED", "check_strategy", "strategy_refusal"]

#: strategy class name -> why the kit does not run under it
REFUSED = {
    "DeepSpeedStrategy": "DeepSpeed runs the model and its optimizer step inside its own engine (ZeRO partitions the"
                         " parameters and steps outside Lightning's hooks), where the kit's checks, skips, casts and"
                         " replays were never run",
    "FSDPStrategy": "FSDP1 flattens each wrapped module's parameters into one FlatParameter, which the kit's per-module"
                    " checks, casts and replays do not see",
}
#: what runs instead
INSTEAD = ("use strategy='ddp', or for a sharded model ModelParallelStrategy with fully_shard in configure_model"
           " (FSDP2; docs/sharded.md)")


def strategy_refusal(strategy: type) -> str | None:
    """Why the kit refuses a strategy of this class (or a subclass of a refused one), or ``None``.

    Example:
        >>> from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
        >>> strategy_refusal(DDPStrategy) is None, strategy_refusal(DeepSpeedStrategy)[:27]
        (True, 'DeepSpeed runs the model an')
    """
    return next((REFUSED[c.__name__] for c in strategy.__mro__ if c.__name__ in REFUSED), None)


def check_strategy(trainer: pl.Trainer, owner: str) -> None:
    """Raise at setup when ``trainer``'s strategy is one the kit refuses, naming it, why, and what works.

    Args:
        trainer: the trainer being set up.
        owner: the callback, for the message.

    Example:
        >>> check_strategy(pl.Trainer(logger=False, enable_progress_bar=False), "NaNDetector")
    """
    why = strategy_refusal(type(trainer.strategy))
    if why is not None:
        raise ValueError(f"{owner} does not run under Lightning's {type(trainer.strategy).__name__}: {why}; {INSTEAD}")
