"""What NaNDetector reports: where the first non-finite value came from, why, and what was done about it.

The report's text and fields are written to TensorBoard (and the Trainer's other loggers) here too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_opkit.core.logging import markdown_table

if TYPE_CHECKING:
    from lightning_opkit.core.logging import LogWriter

__all__ = ["Cause", "NaNReport", "NonFiniteError", "Origin", "amended", "format_report", "not_reproduced",
           "write_report"]


@dataclass(frozen=True)
class Origin:
    """Where a replay saw the first non-finite value.

    That is a module's output or input-gradient, a parameter's gradient, the loss, or nowhere (``module=None``: the
    check saw it, the replay did not).

    Args:
        phase: ``"forward"``, ``"backward"`` or ``"loss"``.
        module: the module's path (``""`` for the LightningModule's loss), ``None`` when not reproduced.
        module_type: its class name.
        op_class: its operator class.
        parameter: the parameter whose gradient went non-finite, if that is what was found.
        dtype: the dtype of the non-finite tensor.
        nan: NaN count in it.
        inf: Inf count in it.
        input_min: finite minimum of its inputs (forward) or output gradients (backward).
        input_max: finite maximum of them.
        input_absmax: finite abs-maximum of them.
    """

    phase: str
    module: str | None
    module_type: str = "-"
    op_class: str = "-"
    parameter: str | None = None
    dtype: str = "-"
    nan: int = 0
    inf: int = 0
    input_min: float | None = None
    input_max: float | None = None
    input_absmax: float | None = None
    #: where in the replayed step it was seen (forward records, then the loss, then backward records): across ranks
    #: the smallest is the first (under tensor parallel a rank's bad shard makes every rank's next output bad)
    seq: int = dataclasses.field(default=-1, compare=False, repr=False)

    @property
    def reproduced(self) -> bool:
        """Whether a replay saw it (and so named where it came from)."""
        return self.module is not None


@dataclass(frozen=True)
class Cause:
    """Why the step went non-finite (see :mod:`lightning_opkit.nan.replays`), and what to try.

    Args:
        cause: ``"precision"``, ``"data_or_model"``, ``"transient"`` or ``"unknown"``.
        advice: one sentence for the user.
    """

    cause: str
    advice: str


#: what a fault the check saw and no replay reproduced is put down to
TRANSIENT = Cause("transient", "seen by the check, not reproduced by the replay: non-deterministic code or hardware")
#: the same, where the step ran compiled and every replay runs eagerly
TRANSIENT_COMPILED = Cause("transient", "seen by the check, not reproduced in an eager replay of a step that ran"
                                        " compiled: the compiled code (Inductor's kernels, CUDA graphs) may compute"
                                        " differently from eager, so suspect it first (TorchCompile off for a run"
                                        " tells), then non-deterministic code or hardware")


def not_reproduced(compiled: bool, by_replay_as_is: bool = False) -> Cause:
    """The ``transient`` cause: not reproduced, in words that say whether the step ran compiled.

    Args:
        compiled: the step ran compiled; replays run eagerly, so "not reproduced" says less.
        by_replay_as_is: a cause replay did not reproduce what the localization replay had seen.

    Example:
        >>> not_reproduced(compiled=False).advice
        'seen by the check, not reproduced by the replay: non-deterministic code or hardware'
    """
    if not by_replay_as_is:
        return TRANSIENT_COMPILED if compiled else TRANSIENT
    if compiled:
        return Cause("transient", "not reproduced by a second eager replay of a step that ran compiled: the"
                                  " compiled code may compute differently from eager, or the code or hardware is"
                                  " non-deterministic")
    return Cause("transient", "not reproduced by a second replay as is: non-deterministic code or hardware")
#: a sharded gradient found non-finite in the step's own shards, which a replay's parameter hooks do not see
SHARD_ONLY = Cause("unknown", "found in the step's own gradient shard; a sharded parameter's gradient is reduced"
                              " outside autograd, so no replay can tell where in backward it went non-finite")


@dataclass(frozen=True)
class NaNReport:
    """One fault (a non-finite value, or a spike): the step, the origin, the cause and the action.

    :meth:`as_dict` is its public view (``NaNDetector.events``, ``NonFiniteError.report``, checkpoints).

    Args:
        step: the global step.
        epoch: the epoch.
        batch_idx: the batch (the micro-batch that reproduced it, under accumulation).
        rank: the global rank whose replay found the origin.
        origin: where it came from.
        cause: why, when a cause replay ran.
        action: the detector's action.
        repair: what was repaired after it (``"<module> -> fp32"``), else ``None``.
        kind: ``"non_finite"`` or ``"spike"``.
        loss: a spike's loss (the mean over its micro-batches on the rank that spiked).
        zscore: a spike's score: deviations above the recent good steps (the loss's, or the gradient norm's).
        top_modules: a spike's modules whose outputs departed most from the last good batch's, first first.
        top_parameters: a spike's parameters whose gradient norms jumped most against their running norms.

    Example:
        >>> report = NaNReport(3, 0, 3, 0, Origin(phase="loss", module="", module_type="Net", op_class="loss", nan=1),
        ...                    action="skip")
        >>> report.as_dict()["module_type"], NaNReport.from_dict(report.as_dict()) == report
        ('Net', True)
    """

    step: int
    epoch: int
    batch_idx: int
    rank: int
    origin: Origin
    cause: Cause | None = None
    action: str = "raise"
    repair: str | None = None
    kind: str = "non_finite"
    loss: float | None = None
    zscore: float | None = None
    top_modules: tuple[str, ...] = ()
    top_parameters: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The flat dict view: where, what and why, and what was done.

        That is: step, epoch, batch_idx, rank, kind, the origin's fields, cause, advice, action, repair, and a
        spike's loss, zscore, top modules and parameters.
        """
        cause = {"cause": self.cause.cause, "advice": self.cause.advice} if self.cause else {"cause": None,
                                                                                                "advice": None}
        origin = {k: v for k, v in dataclasses.asdict(self.origin).items() if k != "seq"}
        return {"step": self.step, "epoch": self.epoch, "batch_idx": self.batch_idx, "rank": self.rank,
                "kind": self.kind, **origin, **cause, "action": self.action, "repair": self.repair, "loss": self.loss,
                "zscore": self.zscore, "top_modules": list(self.top_modules),
                "top_parameters": list(self.top_parameters)}

    @classmethod
    def from_dict(cls, view: dict[str, Any]) -> NaNReport:
        """Back from :meth:`as_dict` (a checkpoint's events); unknown keys are ignored."""
        fields = {f.name for f in dataclasses.fields(Origin)} - {"seq"}
        origin = Origin(**{k: v for k, v in view.items() if k in fields})
        cause = Cause(view["cause"], view.get("advice") or "") if view.get("cause") else None
        return cls(int(view.get("step", -1)), int(view.get("epoch", 0)), int(view.get("batch_idx", -1)),
                   int(view.get("rank", 0)), origin, cause, str(view.get("action", "raise")), view.get("repair"),
                   str(view.get("kind", "non_finite")), view.get("loss"), view.get("zscore"),
                   tuple(view.get("top_modules") or ()), tuple(view.get("top_parameters") or ()))


def amended(report: NaNReport, scaler: bool, pinned_before: bool, repair: str | None) -> NaNReport:
    """``report`` with what was done or cannot be done added to its cause's advice.

    Args:
        report: the report as the replays made it.
        scaler: a GradScaler scales the loss (it cannot fix a forward overflow: said for forward and loss faults).
        pinned_before: its module had been pinned to fp32 after an earlier fault: the pin did not hold.
        repair: the repair just made (``"<module> -> fp32"``), if any.

    Example:
        >>> report = NaNReport(3, 0, 3, 0, Origin(phase="forward", module="fc"), Cause("precision", "finite in fp32"))
        >>> amended(report, scaler=False, pinned_before=False, repair="fc -> fp32").cause.advice
        "finite in fp32; repaired: 'fc' runs in fp32 from the next step on (NaNDetector(repair=True))"
    """
    cause, path = report.cause, report.origin.module
    if cause is None:
        return report
    notes = []
    if scaler and report.origin.phase in ("forward", "loss"):
        notes.append("loss scaling cannot fix a forward overflow (the GradScaler only skips the step and lowers its"
                     " scale, which changes nothing in the forward)")
    if pinned_before:
        notes.append(f"{path!r} was pinned to fp32 after an earlier fault and went non-finite again there: the pin"
                     " did not hold, and is not retried")
    if repair is not None:
        notes.append(f"repaired: {path!r} runs in fp32 from the next step on (NaNDetector(repair=True))")
    if not notes:
        return report
    return dataclasses.replace(report, cause=Cause(cause.cause, f"{cause.advice}; " + "; ".join(notes)),
                               repair=repair)


class NonFiniteError(RuntimeError):
    """A non-finite value was found; ``.report`` holds the first report as a dict.

    Args:
        report: the report (step, phase, module, module type, op class, dtype, NaN/Inf counts, input range).
        reason: an optional lead sentence (for example, why a skip turned into a raise).
    """

    def __init__(self, report: NaNReport | dict[str, Any], reason: str = "") -> None:
        self.nan_report = report if isinstance(report, NaNReport) else NaNReport.from_dict(report)
        self.report = self.nan_report.as_dict()
        super().__init__((reason + " " if reason else "") + format_report(self.report))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled across ranks and by multiprocessing: rebuilt from the report, not from the message.
        return type(self), (self.report,)


# Pickles name the class by its public path, which stays when the files behind it move.
NonFiniteError.__module__ = "lightning_opkit"


def format_report(report: NaNReport | dict[str, Any]) -> str:
    """One readable paragraph for a NaN report.

    Args:
        report: a report, or its dict view from :attr:`NaNDetector.events`.

    Example:
        >>> format_report({"step": 3, "phase": "loss", "module": "", "module_type": "Net", "nan": 1, "inf": 0})
        'Non-finite loss at global step 3 (the loss of Net): 1 NaN and 0 Inf values.'
    """
    r = report.as_dict() if isinstance(report, NaNReport) else report
    cause = f" Cause: {r['cause']}: {r['advice']}." if r.get("cause") else ""
    if r.get("kind") == "spike":
        return _format_spike(r) + cause
    phase, step = r["phase"], r["step"]
    where = {"forward": "output", "backward": "gradient", "loss": "loss"}.get(phase, phase)
    if r.get("module") is None:
        return (
            f"Non-finite {where} at global step {step}, seen by the per-step check but not reproduced when the step"
            f" was replayed with per-module hooks, so no module can be named (is the model non-deterministic?)."
        ) + cause
    if phase == "loss":
        return (f"Non-finite loss at global step {step} (the loss of {r['module_type']}): "
                f"{r['nan']} NaN and {r['inf']} Inf values.") + cause
    subject = f"module '{r['module']}' ({r['module_type']}, op class {r['op_class']})"
    if r.get("parameter"):
        subject = f"the gradient of parameter '{r['parameter']}' of " + subject
    made = "its output" if phase == "forward" else "the gradient of its inputs"
    text = (f"Non-finite {where} at global step {step}, first produced in the {phase} pass by {subject}"
            f" in dtype {r['dtype']}: {made} had {r['nan']} NaN and {r['inf']} Inf values")
    if (phase == "forward" or not r.get("parameter")) and r.get("input_min") is not None:
        rng = f"min {r['input_min']:.4g}, max {r['input_max']:.4g}, abs-max {r['input_absmax']:.4g}"
        text += f" while its {'inputs' if phase == 'forward' else 'output gradients'} were finite ({rng})"
    return text + "." + cause


def _format_spike(r: dict[str, Any]) -> str:
    what = "loss" if r["phase"] == "loss" else "gradient norm"
    text = (f"{what.capitalize()} spike at global step {r['step']} (batch {r['batch_idx']}): loss {r['loss']:.4g},"
            f" {r['zscore']:.1f} deviations above the recent good steps")
    if r.get("module"):
        text += f"; the first module whose outputs departed from the last good batch's: '{r['module']}'"
    elif r.get("module") is not None:
        text += "; no module's outputs departed from the last good batch's: the batch itself differs"
    if r.get("top_parameters"):
        text += f"; gradients jumped most in {', '.join(r['top_parameters'])}"
    return text + "."


def write_report(writer: LogWriter, report: NaNReport, step: int) -> None:
    """``opkit/nan/report`` (the report and its fields) and ``opkit/nan/cause``.

    Args:
        writer: the detector's writer.
        report: the report.
        step: the global step.
    """
    rows = [[key, "-" if value is None else value] for key, value in report.as_dict().items()]
    writer.text("opkit/nan/report", format_report(report) + "\n\n" + markdown_table(["field", "value"], rows), step)
    if report.cause is not None:
        writer.text("opkit/nan/cause", f"**{report.cause.cause}**: {report.cause.advice}", step)
    writer.flush()
