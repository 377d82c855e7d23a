"""A ``rules="auto"`` decision kept for later: in the checkpoint, and as the arguments that run it unmeasured.

A resumed fit runs the checkpoint's decision without measuring again; the next run can be given the explicit
arguments the summary prints instead of ``"auto"``, and measures nothing at all.
"""

from __future__ import annotations

from typing import Any

from lightning_opkit.precision.auto import Plan
from lightning_opkit.precision.dtypes import GOVERNED

__all__ = ["pinned_arguments", "plan_from_state", "plan_state"]


def plan_state(plan: Plan) -> dict[str, Any]:
    """``plan`` as checkpoint state (plain types).

    Args:
        plan: the plan the policy runs.

    Example:
        >>> plan_state(Plan({"matmul": ("bf16", "1.8x faster")}))
        {'classes': {'matmul': ['bf16', '1.8x faster']}, 'autocast': None}
    """
    return {"classes": {c: [d, why] for c, (d, why) in plan.classes.items()}, "autocast": plan.autocast}


def plan_from_state(state: dict[str, Any]) -> Plan:
    """The plan :func:`plan_state` wrote, its reasons marked as restored.

    Args:
        state: what :func:`plan_state` returned.

    Example:
        >>> plan_from_state({"classes": {"matmul": ["bf16", "1.8x faster"]}, "autocast": None}).classes
        {'matmul': ('bf16', '1.8x faster (measured before the checkpoint)')}
    """
    classes = {c: (d, f"{why} (measured before the checkpoint)") for c, (d, why) in state["classes"].items()}
    return Plan(classes, state.get("autocast"))


def pinned_arguments(table: dict[str, str], autocast: str | None) -> str:
    """How to run this decision in the next run without measuring: the arguments to write instead of ``"auto"``.

    Args:
        table: op class -> dtype name, as decided.
        autocast: plain autocast's dtype, when that is what won.

    Example:
        >>> pinned_arguments({c: "fp32" for c in GOVERNED} | {"matmul": "bf16"}, None)[:56]
        "PrecisionPolicy(rules={'matmul': 'bf16', 'conv': 'fp32',"
        >>> pinned_arguments({}, "bf16")
        "Trainer(precision='bf16-mixed') without a PrecisionPolicy (plain autocast won)"
    """
    if autocast is not None:
        return f"Trainer(precision='{autocast}-mixed') without a PrecisionPolicy (plain autocast won)"
    rules = {c: table[c] for c in GOVERNED if c in table}
    return f"PrecisionPolicy(rules={rules!r})"
