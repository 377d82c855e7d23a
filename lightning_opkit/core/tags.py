"""Every tag opkit writes: its kind, unit, when it is written and by whom; the docs' tag reference is made from it.

:class:`~lightning_opkit.core.logging.LogWriter` checks each tag it writes against this list and warns, once per tag,
of one it does not hold (the test suite turns that warning into an error), so the reference cannot fall behind the
code. ``<class>`` stands for an operator class (:mod:`lightning_opkit.opclass`).

    make docs-tags      # rewrites docs/tags.md from this list
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from functools import cache

__all__ = ["TAGS", "Tag", "UnlistedTagWarning", "check", "markdown"]


@dataclass(frozen=True)
class Tag:
    """One tag (or a family, with ``<class>`` in it).

    Args:
        name: ``opkit/<area>/...``.
        kind: ``"scalar"``, ``"text"`` or ``"image"``.
        unit: the scalar's unit (``""`` for text and images).
        when: when it is written, and with which option.
        meaning: what it holds.
    """

    name: str
    kind: str
    unit: str
    when: str
    meaning: str


_WINDOW = "each profiler window's end"
_ROOF = "each window, `roofline=True`"
_MEM = "each window, `memory_breakdown=True`"
_CENSUS = "each census step (`census_every_n_steps`)"
_COUNTERS = "each event's step and each epoch end"
_COMPILE = "when they change (checked each step)"

TAGS: tuple[Tag, ...] = (
    Tag("opkit/summary", "text", "", "the fit's end or exception (first opkit callback, rank zero)",
        "where the logs are, the `tensorboard --logdir` command, and every callback's findings"),
    # PrecisionPolicy
    Tag("opkit/precision/policy", "text", "", "setup, and after `rules='auto'` decides",
        "the effective table, why (the evidence under `auto`), the module overrides"),
    Tag("opkit/precision/sensitivity", "text", "", "`auto` or `measure`, once measured",
        "per class x dtype: ops per step, fp32 ms, speed against fp32, chosen; the whole-step candidates"),
    Tag("opkit/precision/decision", "text", "", "`auto`: the decision, and again when the trials end",
        "the chosen table's error beside plain bf16-mixed's, trial medians, each class's dtype and evidence, and"
        " each Linear's float8 figures and verdict where float8 was measured"),
    Tag("opkit/precision/measure_s", "scalar", "s", "each measurement of `rules='auto'`",
        "seconds the measurement took"),
    Tag("opkit/precision/census", "text", "", _CENSUS,
        "class, dtype it ran in, decided by, calls, relative error, underflow, max |output|, fp16 headroom"),
    Tag("opkit/precision/<class>/calls", "scalar", "calls", _CENSUS, "the class's calls in the census step"),
    Tag("opkit/precision/<class>/rel_error", "scalar", "ratio", _CENSUS,
        "worst relative error of the class's 16-bit outputs against an fp32 recompute"),
    Tag("opkit/precision/<class>/underflow_frac", "scalar", "fraction", _CENSUS,
        "share of the class's 16-bit outputs lost to underflow"),
    Tag("opkit/precision/<class>/headroom_bits", "scalar", "bits", _CENSUS,
        "least fp16 headroom below overflow (classes that ran in fp16)"),
    # NaNDetector
    Tag("opkit/nan/events", "scalar", "events", _COUNTERS, "cumulative faults (non-finite values and spikes)"),
    Tag("opkit/nan/skipped_steps", "scalar", "steps", _COUNTERS, "optimizer steps skipped (`action='skip'`)"),
    Tag("opkit/nan/consecutive_skips", "scalar", "steps", _COUNTERS, "skips in a row (`max_consecutive_skips`)"),
    Tag("opkit/nan/repairs", "scalar", "modules", _COUNTERS, "modules pinned to fp32 after a precision fault"),
    Tag("opkit/nan/spikes", "scalar", "spikes", _COUNTERS, "cumulative loss and gradient-norm spikes"),
    Tag("opkit/nan/dead_parameters", "scalar", "parameters", f"{_COUNTERS}, `dead_after`",
        "parameters and experts with no gradient for `dead_after` steps"),
    Tag("opkit/nan/dead_parameters", "text", "", "when one is found (`dead_after`)",
        "each dead parameter or expert: since which step, frozen or not"),
    Tag("opkit/nan/report", "text", "", "each event", "the report as a paragraph and a table (cause and advice in it)"),
    Tag("opkit/nan/cause", "text", "", "each event whose cause was replayed", "the cause and what to try"),
    # ProfilerWindows
    Tag("opkit/profiler/windows", "scalar", "windows", _WINDOW, "windows so far"),
    Tag("opkit/profiler/step_time_ms", "scalar", "ms", _WINDOW, "mean wall time of the window's recorded steps"),
    Tag("opkit/profiler/profiled_steps", "scalar", "steps", _WINDOW, "recorded steps in the window"),
    Tag("opkit/profiler/framework_ms", "scalar", "ms / step", _WINDOW,
        "self time of framework spans (ProfilerStep, Optimizer.step, data loading), apart from the class shares"),
    Tag("opkit/profiler/peak_memory_mb", "scalar", "MB", f"{_WINDOW}, `profile_memory` or `memory_breakdown`",
        "CUDA: the allocator's maximum; CPU: the peak of the window's allocations"),
    Tag("opkit/profiler/gflops_per_s", "scalar", "GFLOP/s", f"{_WINDOW}, `with_flops`", "the profiler's FLOPs / time"),
    Tag("opkit/profiler/export_s", "scalar", "s", f"{_WINDOW}, `export_trace`", "time to write the trace"),
    Tag("opkit/profiler/export_errors", "scalar", "exports", "a trace export that failed",
        "failed exports (unwritable directory, full disk); training goes on"),
    Tag("opkit/profiler/<class>/self_ms", "scalar", "ms / step", _WINDOW, "the class's self time per step"),
    Tag("opkit/profiler/<class>/percent", "scalar", "%", _WINDOW, "the class's share of profiled self time"),
    Tag("opkit/profiler/communication/ms", "scalar", "ms / step", f"{_WINDOW}, when collectives ran",
        "communication wall time (merged intervals)"),
    Tag("opkit/profiler/communication/exposed_ms", "scalar", "ms / step", f"{_WINDOW}, when collectives ran",
        "communication no compute overlapped"),
    Tag("opkit/profiler/communication/exposed_percent", "scalar", "%", f"{_WINDOW}, when collectives ran",
        "exposed communication as a share of the step"),
    Tag("opkit/profiler/top_ops", "text", "", _WINDOW, "the top `top_k` ops: calls, self and total ms, %, GFLOP"),
    Tag("opkit/profiler/op_classes", "text", "", _WINDOW, "time per operator class"),
    Tag("opkit/profiler/<class>/tflops", "scalar", "TFLOP/s", _ROOF, "the class's achieved FLOP rate"),
    Tag("opkit/profiler/<class>/gbps", "scalar", "GB/s", _ROOF, "the class's achieved bytes per second"),
    Tag("opkit/profiler/<class>/pct_peak", "scalar", "%", _ROOF, "of the measured GEMM peak of its dtype(s)"),
    Tag("opkit/profiler/<class>/pct_bandwidth", "scalar", "%", _ROOF, "of the measured copy bandwidth"),
    Tag("opkit/profiler/<class>/intensity", "scalar", "FLOP/B", _ROOF, "arithmetic intensity"),
    Tag("opkit/profiler/communication/gbps", "scalar", "GB/s", f"{_ROOF}, when collectives ran",
        "collective bytes per second"),
    Tag("opkit/profiler/communication/pct_link", "scalar", "%", f"{_ROOF}, under DDP / FSDP2",
        "of the measured all_reduce bandwidth"),
    Tag("opkit/profiler/mfu", "scalar", "%", _ROOF,
        "step MFU against the peaks of the dtypes that ran (none above 100%)"),
    Tag("opkit/profiler/mfu_fp32", "scalar", "%", _ROOF,
        "step MFU against the fp32 peak (where fp32 GEMMs ran; none above 100%)"),
    Tag("opkit/profiler/mfu_bf16", "scalar", "%", _ROOF,
        "step MFU against the bf16 peak (where bf16 GEMMs ran; none above 100%)"),
    Tag("opkit/profiler/model_tflops", "scalar", "TFLOP/s", _ROOF, "the step's GEMM-like FLOPs over its time"),
    Tag("opkit/profiler/roofline", "text", "", _ROOF, "the peaks, per-class rows, each class's lever, the MFU line"),
    Tag("opkit/profiler/roofline_plot", "image", "", _ROOF,
        "intensity against achieved TFLOP/s per class, a roof per measured dtype"),
    Tag("opkit/memory/parameters_mb", "scalar", "MB", _MEM, "parameters (local shards), exact"),
    Tag("opkit/memory/gradients_mb", "scalar", "MB", _MEM, "gradients before the optimizer step, exact"),
    Tag("opkit/memory/optimizer_mb", "scalar", "MB", _MEM, "the optimizer's state, exact"),
    Tag("opkit/memory/activations_mb", "scalar", "MB", _MEM, "what autograd saves for backward, each storage once"),
    Tag("opkit/memory/peak_mb", "scalar", "MB", _MEM, "CUDA: the allocator's peak; CPU: the profiler's"),
    Tag("opkit/memory/modules", "text", "", _MEM, "bytes by kind, activations by block and module, the lever"),
    Tag("opkit/memory/op_classes", "text", "", _MEM, "activations by the op class that produced them"),
    Tag("opkit/memory/blocks", "image", "", _MEM, "stacked bars per block by producing op class"),
    # TorchCompile
    Tag("opkit/compile/config", "text", "", "setup", "the settings and the compiled regions"),
    Tag("opkit/compile/compile_time_s", "scalar", "s", _COMPILE, "cumulative compile time"),
    Tag("opkit/compile/compiles", "scalar", "compiles", _COMPILE, "cumulative compilations"),
    Tag("opkit/compile/graphs", "scalar", "graphs", _COMPILE, "graphs compiled"),
    Tag("opkit/compile/graph_breaks", "scalar", "breaks", _COMPILE, "graph breaks"),
    Tag("opkit/compile/graph_break_reasons", "text", "", _COMPILE, "each break's reason and count"),
    Tag("opkit/compile/recompiles", "scalar", "recompiles", _COMPILE, "recompilations"),
    Tag("opkit/compile/recompile_reasons", "text", "", _COMPILE, "function, the guard that failed, count"),
    Tag("opkit/compile/step_time_ms", "scalar", "ms", _COMPILE, "median steady-state step time (no compile in it)"),
    Tag("opkit/compile/regions", "text", "", "regional compile, when they change",
        "per region: calls, compiles, compile s, graphs, breaks, recompiles, measured speedup, compiled or eager"),
    Tag("opkit/compile/eager_regions", "scalar", "regions", "regional compile, when they change",
        "regions running eagerly (measured slower compiled, or after recompiles)"),
    Tag("opkit/compile/eager_fallback", "scalar", "0/1", "compilation failed", "1: the run went on eagerly"),
    Tag("opkit/compile/error", "text", "", "compilation failed", "the error, and that training continues eagerly"),
    # ActivationCheckpointing
    Tag("opkit/checkpointing/config", "text", "", "setup", "the checkpointed blocks and what each keeps"),
    Tag("opkit/checkpointing/saved_mb_without", "scalar", "MB", "once measured (`measure=True`)",
        "activation bytes saved for backward without checkpointing (median step)"),
    Tag("opkit/checkpointing/saved_mb_with", "scalar", "MB", "once measured (`measure=True`)",
        "activation bytes saved with checkpointing (median step)"),
    Tag("opkit/checkpointing/saved_cut", "scalar", "fraction", "once measured (`measure=True`)",
        "share of the saved bytes checkpointing removes"),
    Tag("opkit/checkpointing/step_ms_without", "scalar", "ms", "once measured (`measure=True`)",
        "median step time without checkpointing"),
    Tag("opkit/checkpointing/step_ms_with", "scalar", "ms", "once measured (`measure=True`)",
        "median step time with it"),
    Tag("opkit/checkpointing/time_ratio", "scalar", "ratio", "once measured (`measure=True`)",
        "step time with over without"),
    Tag("opkit/checkpointing/report", "text", "", "once measured (`measure=True`)", "the price in one line"),
)


class UnlistedTagWarning(UserWarning):
    """A tag written that :data:`TAGS` does not list: the tag reference is behind the code."""


def _pattern(name: str) -> str:
    return re.escape(name).replace(re.escape("<class>"), "[a-z_0-9]+")


@cache
def _listed(tag: str, kind: str) -> bool:
    return any(t.kind == kind and re.fullmatch(_pattern(t.name), tag) for t in TAGS)


def check(tag: str, kind: str) -> None:
    """Warn (:class:`UnlistedTagWarning`, once per tag) when ``tag`` of ``kind`` is not in :data:`TAGS`.

    Example:
        >>> check("opkit/profiler/matmul/self_ms", "scalar")
    """
    if not _listed(tag, kind):
        warnings.warn(f"opkit writes {kind} {tag!r}, which lightning_opkit/core/tags.py does not list",
                      UnlistedTagWarning, stacklevel=3)


def markdown() -> str:
    """The tag reference page (``docs/tags.md``), from :data:`TAGS`."""
    lines = ["# TensorBoard tags", "",
             "Every tag opkit writes, made from `lightning_opkit/core/tags.py` (`make docs-tags`); the test suite"
             " fails on a tag written that is not listed here. `<class>` is an operator class"
             " ([how it works](how-it-works.md#the-operator-classes)). Scalars go to TensorBoard's Scalars tab"
             " and to the Trainer's other loggers; text to the Text tab (a CSV logger: `.md` files beside its"
             " metrics); images to the Images tab. All are written by global rank zero.", ""]
    area = ""
    for tag in TAGS:
        head = tag.name.split("/")[1]
        if head != area:
            area = head
            lines += ["", f"## `opkit/{area}`", "", "| tag | kind | unit | written | what it holds |",
                      "|---|---|---|---|---|"]
        lines.append(f"| `{tag.name}` | {tag.kind} | {tag.unit or '-'} | {tag.when} | {tag.meaning} |")
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"
