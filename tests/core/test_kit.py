"""How a callback finds the others (core/kit.py): by the protocols each offers, in the Trainer's order; one that is off
or not opkit's is no member. A Trainer is built (its callbacks list is what is read), never fitted."""

import lightning.pytorch as pl

from lightning_opkit import ActivationCheckpointing, NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile
from lightning_opkit.core.kit import (
    CompilesRegions,
    HearsOfFailure,
    LoadsSteps,
    PinsModules,
    RunsModulesInDtype,
    TimesSteps,
    measuring_besides,
    members,
    offering,
)


def _trainer(callbacks):
    return pl.Trainer(callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False)


def test_the_five_are_members_in_order_and_each_offers_what_it_makes():
    kit = [PrecisionPolicy(), NaNDetector(), ProfilerWindows(), TorchCompile(), ActivationCheckpointing()]
    trainer = _trainer([pl.Callback(), *kit])
    assert members(trainer) == kit  # Lightning's own callbacks and a plain one are not
    offers = {offer.__name__: [type(c).__name__ for c in offering(trainer, offer)]
              for offer in (CompilesRegions, HearsOfFailure, LoadsSteps, PinsModules, RunsModulesInDtype, TimesSteps)}
    assert offers == {"CompilesRegions": ["TorchCompile"], "HearsOfFailure": ["ProfilerWindows"],
                      "LoadsSteps": ["PrecisionPolicy"],
                      "PinsModules": ["PrecisionPolicy"], "RunsModulesInDtype": ["PrecisionPolicy"],
                      "TimesSteps": ["PrecisionPolicy", "TorchCompile", "ActivationCheckpointing"]}
    # before a fit nothing times its alternatives on the steps
    assert not any(measuring_besides(trainer, c) for c in kit)


def test_a_callback_that_is_off_is_no_member():
    on, off = NaNDetector(), ProfilerWindows(enabled=False)
    trainer = _trainer([off, on])
    assert members(trainer) == [on]
    assert list(offering(trainer, CompilesRegions)) == []
