"""PrecisionPolicy's arguments: checked at construction (naming the bad value and the valid ones), and the table."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_opkit.core.checks import check_bools, check_fraction, check_int
from lightning_opkit.opclass import OP_CLASSES
from lightning_opkit.precision.dtypes import DTYPES, FP8_NEXT, GOVERNED, NAMES, NEVER_CAST, hardware_note

__all__ = ["AUTOCAST_DTYPE", "DEFAULT_RULES", "check_one_low_dtype", "check_policy_args", "fit_table", "initial_table"]

#: GEMMs and GELU-like activations on Tensor Cores in bf16; variance, exponent and large-sum ops in fp32.
DEFAULT_RULES: dict[str, str] = {
    "matmul": "bf16", "conv": "bf16", "attention": "bf16", "activation": "bf16",
    "norm": "fp32", "softmax": "fp32", "loss": "fp32", "reduction": "fp32",
}


def check_policy_args(rules: Any, default: Any, overrides: Any, tolerance: Any, counts: dict[str, Any],
                      flags: dict[str, Any]) -> None:
    """Raise for the first bad ``PrecisionPolicy`` argument.

    Args:
        rules: ``"auto"``, op class -> dtype name, or ``None``.
        default: a dtype name.
        overrides: module glob -> dtype name, or ``None``.
        tolerance: a number in ``[0, 1)``.
        counts: the int arguments (at least 0), by name.
        flags: the bool arguments, by name.

    Example:
        >>> check_policy_args({"matmul": "half"}, "keep", None, 0.01, {}, {})
        Traceback (most recent call last):
        ...
        ValueError: `rules['matmul']` is 'half'; expected one of ['fp32', 'bf16', 'fp16', 'fp8', 'keep']
    """
    valid = list(NAMES)
    if not isinstance(default, str) or default not in DTYPES:
        raise ValueError(f"Expected `default` to be one of {list(DTYPES)}, but got {default!r}"
                         + (" ('fp8' is a GEMM dtype: set rules={'matmul': 'fp8'})" if default == "fp8" else ""))
    if rules != "auto" and rules is not None and not isinstance(rules, dict):
        raise ValueError(f"Expected `rules` to be 'auto', a dict of op class -> dtype (for example"
                         f" {{'matmul': 'bf16'}}) or None, but got {rules!r}")
    _check_rules(rules if isinstance(rules, dict) else {})
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"Expected `overrides` to be a dict of module glob -> dtype (for example"
                         f" {{'model.head': 'fp32'}}) or None, but got {overrides!r}")
    for key, value in (overrides or {}).items():
        if not isinstance(key, str) or not isinstance(value, str) or value not in NAMES:
            raise ValueError(f"`overrides[{key!r}]` is {value!r}; expected one of {valid}")
    for name, value in counts.items():
        check_int(name, value, 0)
    check_bools(**flags)
    check_fraction("tolerance", tolerance, "relative loss change and 1 - gradient cosine")


def _check_rules(rules: dict[Any, Any]) -> None:
    governed = list(GOVERNED)
    for key, value in rules.items():
        if key in NEVER_CAST:
            raise ValueError(f"`rules` cannot set op class {key!r}: the policy never casts it. Valid classes are"
                             f" {governed}")
        if not isinstance(key, str) or key not in OP_CLASSES:
            raise ValueError(f"`rules` names unknown op class {key!r}; valid classes are {governed}")
        valid = NAMES if key == "matmul" else list(DTYPES)  # float8 is a GEMM dtype
        if value == "fp8" and key != "matmul":
            raise ValueError(f"`rules[{key!r}]` is 'fp8': float8 runs the GEMMs of Linear layers, the 'matmul' class"
                             f" only (rules={{'matmul': 'fp8'}}, or a module override); {key!r} may be one of"
                             f" {list(DTYPES)}")
        if not isinstance(value, str) or value not in valid:
            raise ValueError(f"`rules[{key!r}]` is {value!r}; expected one of {valid}")


#: the 16-bit dtype a Trainer precision autocasts to: the one a policy's 16-bit classes must share with it
AUTOCAST_DTYPE = {"16-mixed": "fp16", "bf16-mixed": "bf16"}


def initial_table(rules: str | dict[str, str] | None, default: str, low: str = "bf16") -> dict[str, str]:
    """Op class -> dtype name before anything is measured: every class in fp32 under ``"auto"``.

    Args:
        rules: as given to the policy.
        default: the dtype of classes neither ``rules`` nor :data:`DEFAULT_RULES` names.
        low: the 16-bit dtype of :data:`DEFAULT_RULES`' lowered classes (``"fp16"`` under ``precision="16-mixed"``,
            whose autocast runs the rest in fp16).

    Example:
        >>> initial_table({"norm": "bf16"}, "keep")["norm"], initial_table("auto", "keep")["matmul"]
        ('bf16', 'fp32')
        >>> initial_table(None, "keep", low="fp16")["matmul"]
        'fp16'
    """
    if rules == "auto":
        table = dict.fromkeys(GOVERNED, "fp32")
    else:
        table = {cls: DEFAULT_RULES.get(cls, default) for cls in OP_CLASSES}
        table = {cls: low if name == "bf16" and cls in DEFAULT_RULES else name for cls, name in table.items()}
        table.update(rules or {})  # type: ignore[arg-type]
    table.update(dict.fromkeys(NEVER_CAST, "keep"))
    return table


def fit_table(rules: str | dict[str, str] | None, default: str, precision: str, device: torch.device | str,
              hardware: str | None = None) -> dict[str, str]:
    """The table a fit starts with; where the user asked for no 16-bit, what runs in it is said before step 1.

    :func:`initial_table` in the dtype the Trainer autocasts to (the two 16-bit dtypes never mix). Under a precision
    that asks for no 16-bit at all (``32-true``), the built-in table (``rules=None``) lowers nothing the device has no
    native units for: those classes stay in fp32, said once (a hardware fact, before any step: bf16 emulated on a CPU
    runs a GEMM many times slower than fp32); whatever still runs in 16-bit is said at setup.

    Args:
        rules: as given to the policy.
        default: the policy's ``default``.
        precision: the Trainer's precision, as a string.
        device: where the model runs.
        hardware: what the device offers for its 16-bit dtype (default: :func:`hardware_note`; given, in tests).

    Example:
        >>> fit_table(None, "keep", "16-mixed", "cpu")["matmul"]  # under autocast: the Trainer's 16-bit dtype
        'fp16'
    """
    low = AUTOCAST_DTYPE.get(precision, "bf16")
    table = initial_table(rules, default, low)
    if not precision.startswith(("32", "64")) or rules == "auto":
        return table  # autocast or a 16-bit model: the Trainer's precision already asked for 16-bit
    note = hardware_note(device, low) if hardware is None else hardware
    lowered = [c for c in DEFAULT_RULES if table[c] == low] if rules is None else []
    if lowered and note.startswith("no "):
        table.update(dict.fromkeys(lowered, "fp32"))
        rank_zero_warn(f"PrecisionPolicy(): this {torch.device(device).type} has {note}: the built-in table's {low}"
                       f" classes ({', '.join(lowered)}) run in fp32 here, where {low} is emulated and slower."
                       f" rules='auto' measures each class; explicit rules run {low} anyway.")
    sixteen = [c for c in GOVERNED if table[c] in ("bf16", "fp16", "fp8")]
    if sixteen:
        rank_zero_warn(f"PrecisionPolicy under precision={precision!r} (no autocast) lowers "
                       + ", ".join(f"{c} to {table[c]}" for c in sixteen) + f" ({low}: {note or 'no hardware note'});"
                       " every other class runs as written. rules='auto' lowers a class only where it measures"
                       " faster and accurate enough here.")
    return table


def fit_checked(rules: str | dict[str, str] | None, default: str, precision: str, device: torch.device | str,
                overrides: dict[str, str], scaler: bool) -> dict[str, str]:
    """A fit's starting table (:func:`fit_table`), refused at setup where it cannot run beside this precision.

    Args:
        rules: as given to the policy.
        default: the policy's ``default``.
        precision: the Trainer's precision, as a string.
        device: where the model runs.
        overrides: module path -> dtype name, for the modules the overrides matched.
        scaler: whether the Trainer's precision plugin has a GradScaler.

    Example:
        >>> fit_checked({"matmul": "fp16"}, "keep", "bf16-mixed", "cpu", {}, scaler=False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: PrecisionPolicy runs ['matmul'] in fp16 while Trainer(precision='bf16-mixed') autocasts ...
    """
    table = fit_table(rules, default, precision, device)
    check_one_low_dtype(table, overrides, precision)
    check_fp16(table, [n for n, d in overrides.items() if d == "fp16"], scaler, precision)
    return table


def check_fp16(table: dict[str, str], fp16_modules: list[str], scaler: bool, precision: str) -> None:
    """Raise at setup when something runs in fp16 without a GradScaler to scale the loss.

    Args:
        table: op class -> dtype name.
        fp16_modules: paths of the modules overridden to fp16.
        scaler: whether the Trainer's precision plugin has a GradScaler.
        precision: the Trainer's precision, for the message.

    Example:
        >>> check_fp16({"matmul": "fp16"}, [], scaler=True, precision="16-mixed")
    """
    users = [cls for cls, name in table.items() if name == "fp16"] + [f"module {m}" for m in fp16_modules]
    if users and not scaler:
        raise ValueError(
            f"PrecisionPolicy runs {users} in fp16, which needs loss scaling, but Trainer(precision="
            f"{precision!r}) has no GradScaler. Use Trainer(precision='16-mixed') (its GradScaler scales"
            f" the loss), or run those in 'bf16', which has fp32's range."
        )


def check_one_low_dtype(table: dict[str, str], overrides: dict[str, str], precision: str) -> None:
    """Raise at setup when the policy would run a 16-bit dtype other than the one the Trainer autocasts to.

    Under ``precision="16-mixed"`` autocast runs the ops the policy leaves alone in fp16; a class in bf16 beside them
    hands ops that take both (``torch.cat`` in rotary embeddings) a bf16 and a fp16 tensor, and autocast refuses to
    promote those. Likewise fp16 under ``"bf16-mixed"``.

    Args:
        table: op class -> dtype name.
        overrides: module path -> dtype name, for the modules overridden.
        precision: the Trainer's precision.

    Example:
        >>> check_one_low_dtype({"matmul": "bf16"}, {}, "16-mixed")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: PrecisionPolicy runs ['matmul'] in bf16 while Trainer(precision='16-mixed') autocasts the rest ...
    """
    autocast = AUTOCAST_DTYPE.get(str(precision))
    if autocast is None:
        return
    other = "bf16" if autocast == "fp16" else "fp16"

    def label(what: str, name: str) -> str | None:  # fp8's other ops and the Linears it cannot take run in FP8_NEXT
        if name == "fp8" and other == FP8_NEXT:
            return f"{what} (fp8: its other ops in {other})"
        return what if name == other else None

    users = [u for u in (*(label(c, n) for c, n in table.items()),
                         *(label(f"module {p}", n) for p, n in overrides.items())) if u is not None]
    if users:
        instead = "'bf16-mixed'" if other == "bf16" else "'16-mixed'"
        raise ValueError(f"PrecisionPolicy runs {users} in {other} while Trainer(precision={precision!r}) autocasts"
                         f" the rest to {autocast}: ops that take both 16-bit dtypes (torch.cat, ...) fail under"
                         f" autocast. Use {autocast!r} there, or precision='32-true' (the policy alone decides) or"
                         f" {instead}")
