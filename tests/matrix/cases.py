"""The combination matrix's cases: callback sets crossed with optimization, precision and compile, chosen pairwise.

Factors:

- **callbacks**: each of the five alone, every pair, and all five (16 sets), by letter: ``P`` PrecisionPolicy, ``N``
  NaNDetector, ``W`` ProfilerWindows, ``C`` TorchCompile, ``A`` ActivationCheckpointing;
- **optimization**: ``automatic`` or ``manual`` (``automatic_optimization = False``, the step trains itself);
- **precision**: ``32-true``, ``bf16-mixed``, ``16-mixed`` (a GradScaler) and ``bf16-true``;
- **compile**: ``none``, ``regional`` (the zoo model's repeated blocks) or ``whole`` (the LightningModule's forward):
  ``none`` exactly when the set has no ``C``;
- **logging**: ``none`` (``logger=False``: no file may be written) or ``tensorboard`` (a TensorBoardLogger: the
  opkit tags are there);
- **switch**: ``on``, or ``off``: the set's last callback is turned off (``enabled=False`` under automatic
  optimization, ``OPKIT_DISABLE=<its area>`` under manual), and the run must be that of the set without it.

The full product is 704 valid cases. :func:`pairwise` keeps the fewest it can such that every pair of values of two
factors that occurs in some valid case occurs in a kept one (a greedy covering: each step keeps the case that covers
the most pairs not yet covered, then the one whose values were kept least so far, then the first in the product's
order), which is 64 cases: each callback set with each precision once, automatic and manual half each. Each case
trains one zoo model, taken in turn from :data:`MODELS`, so every model meets many combinations. The choice is a pure
function of the factors: the same cases on every run. The fast tier runs in about a minute on 2 cores.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

LETTERS = "PNWCA"
SETS = [*LETTERS, *("".join(p) for p in itertools.combinations(LETTERS, 2)), LETTERS]
OPTIMIZATION = ("automatic", "manual")
PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
COMPILE = ("none", "regional", "whole")
LOGGING = ("none", "tensorboard")
SWITCH = ("on", "off")
#: the zoo models the cases take in turn: attention, convolution with BatchNorm, and two Hugging Face transformers
MODELS = ("torch_mha", "bn_cnn", "hf_gpt2", "torch_encoder", "hf_llama")


@dataclass(frozen=True)
class Case:
    """One combination: the callbacks (letters), how the step optimizes, the Trainer's precision, what is compiled."""

    callbacks: str
    optimization: str
    precision: str
    compile: str
    logging: str = "none"
    switch: str = "on"
    model: str = ""

    @property
    def id(self) -> str:
        off = f"-off{self.off}" if self.off else ""
        return f"{self.callbacks}{off}-{self.optimization}-{self.precision}-{self.compile}-{self.logging}-{self.model}"

    @property
    def off(self) -> str:
        """The letter of the callback that is turned off, if any."""
        return self.callbacks[-1] if self.switch == "off" else ""

    @property
    def active(self) -> str:
        """The letters of the callbacks that act."""
        return self.callbacks.replace(self.off, "") if self.off else self.callbacks

    def factors(self) -> tuple[str, str, str, str, str, str]:
        return self.callbacks, self.optimization, self.precision, self.compile, self.logging, self.switch


def valid(callbacks: str, compile_: str) -> bool:
    """A compile mode goes with TorchCompile in the set, ``none`` without it."""
    return (compile_ != "none") == ("C" in callbacks)


def product() -> list[Case]:
    """Every valid case, in the factors' order."""
    return [Case(*f) for f in itertools.product(SETS, OPTIMIZATION, PRECISION, COMPILE, LOGGING, SWITCH)
            if valid(f[0], f[3])]


def _pairs(case: Case) -> set[tuple[int, str, int, str]]:
    f = case.factors()
    return {(i, f[i], j, f[j]) for i, j in itertools.combinations(range(len(f)), 2)}


def pairwise() -> list[Case]:
    """The greedy pairwise covering of :func:`product`, each case given its model in turn."""
    candidates = product()
    uncovered = set().union(*(_pairs(c) for c in candidates))
    chosen: list[Case] = []
    used: dict[tuple[int, str], int] = {}

    def score(case: Case) -> tuple[int, int]:
        # most new pairs first; among those, the values kept least so far (manual, whole, ... as often as may be)
        return len(_pairs(case) & uncovered), -sum(used.get((i, v), 0) for i, v in enumerate(case.factors()))

    while uncovered:
        best = max(candidates, key=score)  # max keeps the first on a tie
        chosen.append(best)
        uncovered -= _pairs(best)
        candidates.remove(best)
        for i, v in enumerate(best.factors()):
            used[(i, v)] = used.get((i, v), 0) + 1
    return [Case(*c.factors(), model=MODELS[i % len(MODELS)]) for i, c in enumerate(chosen)]


CASES = pairwise()
