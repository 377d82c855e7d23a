"""A ``rules="auto"`` decision as one value: what runs, its checkpoint state, and the arguments that run it again.

:class:`Plan` is the one form a decision takes from rank zero's choice to the policy's table, its checkpoint, its
summary and ``decision_as_arguments()``: each op class's :class:`~lightning_opkit.precision.decide.Decision`, plain
autocast's dtype where that won, and each Linear measured faster in float8 as a ``Decision`` of its own. It is turned
into plain types here and nowhere else (:meth:`Plan.state`, :meth:`Plan.from_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_opkit.precision.decide import Decision
from lightning_opkit.precision.dtypes import DTYPES, FP8, GOVERNED

__all__ = ["Plan", "labelled_overrides", "pinned_arguments"]

_BEFORE = " (measured before the checkpoint)"


_WHERE = "PrecisionPolicy's checkpoint state"


def _check_state(state: Any) -> None:
    """Raise a ``ValueError`` naming the key for state no :meth:`Plan.state` wrote, before anything is applied."""
    if not isinstance(state, dict) or not isinstance(state.get("classes"), dict):
        raise ValueError(f"{_WHERE} 'plan': expected a dict with 'classes' (op class -> [dtype, why]), got {state!r}")
    for cls, entry in state["classes"].items():
        if cls not in GOVERNED:
            raise ValueError(f"{_WHERE} 'plan.classes': unknown op class {cls!r}; expected one of {list(GOVERNED)}")
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0] in DTYPES):
            raise ValueError(f"{_WHERE} 'plan.classes.{cls}': expected [dtype, why] with dtype one of"
                             f" {list(DTYPES)}, got {entry!r}")
    if state.get("autocast") not in (None, "bf16", "fp16"):
        raise ValueError(f"{_WHERE} 'plan.autocast': expected None, 'bf16' or 'fp16', got {state['autocast']!r}")
    for key in ("fp8", "overrides"):
        value = state.get(key, {})
        if not (isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
            raise ValueError(f"{_WHERE} 'plan.{key}': expected a dict of module path -> str, got {value!r}")


@dataclass(frozen=True)
class Plan:
    """What the policy runs from now on: each class's :class:`Decision`, or plain autocast in ``autocast``.

    Args:
        classes: op class -> its decision (dtype and why), for each class the model was seen to run.
        autocast: the dtype of plain ``torch.autocast``, when that is what won.
        fp8: the GEMM modules that run in float8 -> their decision (dtype ``"fp8"``, measured per module).
        added: module overrides given after the decision was made (a resumed fit's): applied on top of it.

    Example:
        >>> plan = Plan({"matmul": Decision("matmul", "bf16", "1.8x faster")},
        ...             fp8={"mlp.up": Decision("matmul", "fp8", "1.4x faster than bf16")})
        >>> plan.dtypes, list(plan.fp8)
        ({'matmul': 'bf16'}, ['mlp.up'])
    """

    classes: dict[str, Decision]
    autocast: str | None = None
    fp8: dict[str, Decision] = field(default_factory=dict)
    added: tuple[str, ...] = ()

    @property
    def dtypes(self) -> dict[str, str]:
        """Op class -> the dtype name decided for it."""
        return {c: d.dtype for c, d in self.classes.items()}

    def state(self, fp8: dict[str, Decision] | None = None, overrides: dict[str, str] | None = None) -> dict[str, Any]:
        """This plan as checkpoint state (plain types).

        Args:
            fp8: the float8 modules that run now, where a repair reverted some of the plan's (``None``: the plan's).
            overrides: the module overrides in force: a resumed fit names those added since.

        Example:
            >>> plan = Plan({"matmul": Decision("matmul", "bf16", "1.8x faster")},
            ...             fp8={"mlp.up": Decision("matmul", "fp8", "1.4x faster than bf16")})
            >>> plan.state()
            {'classes': {'matmul': ['bf16', '1.8x faster']}, 'autocast': None, 'fp8': {'mlp.up': \
'1.4x faster than bf16'}, 'overrides': {}}
        """
        return {"classes": {c: [d.dtype, d.reason] for c, d in self.classes.items()}, "autocast": self.autocast,
                "fp8": {n: d.reason for n, d in (self.fp8 if fp8 is None else fp8).items()},
                "overrides": dict(overrides or {})}

    @classmethod
    def from_state(cls, state: Any, overrides: dict[str, str] | None = None) -> Plan:
        """The plan :meth:`state` wrote, its reasons marked as restored; state it did not write is refused.

        Args:
            state: what :meth:`state` returned.
            overrides: the module overrides of the resumed fit: those not in force at the checkpoint are ``added``.

        Raises:
            ValueError: the state is not a plan (another version's, or tampered with), naming the key (a float8
                module the model lacks is refused where the model is known: ``Float8Linears.choose``).

        Example:
            >>> plan = Plan.from_state({"classes": {"matmul": ["bf16", "1.8x faster"]}, "autocast": None})
            >>> plan.classes
            {'matmul': Decision(op_class='matmul', dtype='bf16', reason='1.8x faster (measured before the checkpoint)')}
            >>> Plan.from_state(plan.state()) == plan
            True
            >>> Plan.from_state(plan.state(), {"head": "fp32"}).added
            ('head',)
            >>> Plan.from_state({"classes": {"matmul": ["bf61", ""]}})
            Traceback (most recent call last):
            ...
            ValueError: PrecisionPolicy's checkpoint state 'plan.classes.matmul': expected [dtype, why] with dtype \
one of ['fp32', 'bf16', 'fp16', 'keep'], got ['bf61', '']
        """
        _check_state(state)

        def restored(why: str) -> str:  # a plan resumed twice was still measured once
            return why if why.endswith(_BEFORE) else why + _BEFORE

        classes = {c: Decision(c, d, restored(why)) for c, (d, why) in state["classes"].items()}
        # a checkpoint written before float8 was measured has no "fp8"; one written before overrides were kept, none
        then = state.get("overrides")
        added = tuple(k for k, v in (overrides or {}).items() if then is not None and then.get(k) != v)
        fp8 = {n: Decision("matmul", FP8, restored(why)) for n, why in state.get("fp8", {}).items()}
        return cls(classes, state.get("autocast"), fp8, added)


def labelled_overrides(overrides: dict[str, str], pinned: dict[str, str], plan: Plan | None) -> dict[str, str]:
    """The summary's module overrides: each glob, a repair's pins and the overrides added after a kept decision named.

    Example:
        >>> labelled_overrides({"head": "fp32"}, {"blocks.1": "fp32"}, Plan({}, added=("head",)))
        {"head (added after the checkpoint's decision, applied on top of it)": 'fp32', \
'blocks.1 (pinned by a NaN repair)': 'fp32'}
    """
    added = plan.added if plan is not None else ()
    return {**{f"{k} (added after the checkpoint's decision, applied on top of it)" if k in added else k: v
               for k, v in overrides.items()},
            **{f"{k} (pinned by a NaN repair)": v for k, v in pinned.items()}}


def pinned_arguments(table: dict[str, str], autocast: str | None, fp8: Sequence[str] = (),
                     recipe: str = "tensorwise") -> str:
    """How to run this decision in the next run without measuring: the arguments to write instead of ``"auto"``.

    Args:
        table: op class -> dtype name, as decided.
        autocast: plain autocast's dtype, when that is what won.
        fp8: the modules measured faster in float8 (module overrides then say ``"fp8"``).
        recipe: their float8 recipe.

    Example:
        >>> pinned_arguments({c: "fp32" for c in GOVERNED} | {"matmul": "bf16"}, None)[:56]
        "PrecisionPolicy(rules={'matmul': 'bf16', 'conv': 'fp32',"
        >>> pinned_arguments({}, "bf16")
        "Trainer(precision='bf16-mixed') without a PrecisionPolicy (plain autocast won)"
        >>> pinned_arguments({}, "bf16", ["mlp.up"])[-44:]
        "'rnn': 'keep'}, overrides={'mlp.up': 'fp8'})"
    """
    overrides = dict.fromkeys(fp8, "fp8")
    extra = (f", overrides={overrides!r}" if overrides else "") + (
        f", fp8_recipe={recipe!r}" if overrides and recipe != "tensorwise" else "")
    if autocast is not None:
        if overrides:  # the policy only for the float8 GEMMs: autocast decides every class
            return (f"Trainer(precision='{autocast}-mixed') with PrecisionPolicy(rules="
                    f"{dict.fromkeys(GOVERNED, 'keep')!r}{extra})")
        return f"Trainer(precision='{autocast}-mixed') without a PrecisionPolicy (plain autocast won)"
    rules = {c: table[c] for c in GOVERNED if c in table}
    return f"PrecisionPolicy(rules={rules!r}{extra})"
