"""What ran in which dtype, and what it cost: per op class and dtype, recorded on device, read with one sync."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_opkit.core.dtypes import autocast_off, cast, short_name
from lightning_opkit.core.logging import markdown_table
from lightning_opkit.core.ranks import local_floats
from lightning_opkit.core.replay import rng_state, set_rng_state
from lightning_opkit.core.torch_compat import outside_dispatch_modes
from lightning_opkit.precision.dtypes import LOW

# Arguments an op updates in place (BatchNorm's running statistics): cast like inputs, the update would go into a
# temporary copy and the buffers would never change. They are cast for the op and the result is copied back.
UPDATED_ARGS: dict[Any, tuple[tuple[int, ...], tuple[str, ...]]] = {
    F.batch_norm: ((1, 2), ("running_mean", "running_var")),
    F.instance_norm: ((1, 2), ("running_mean", "running_var")),
    torch.batch_norm: ((3, 4), ("running_mean", "running_var")),
    torch.instance_norm: ((3, 4), ("running_mean", "running_var")),
}


def fp32_reference(func: Callable[..., Any], args: tuple, kwargs: dict, rng: tuple[Tensor, Any]) -> Any:
    """``func`` run again in fp32 on the same (uncast) inputs, autocast off, leaving no trace; ``None`` if it cannot.

    Args:
        func: the op, as a ``TorchFunctionMode`` receives it.
        args: its positional arguments as the caller passed them (before any policy cast).
        kwargs: its keyword arguments.
        rng: the RNG state the op started from: an op that draws random numbers (attention with dropout) draws the
            same ones again, and the run's random stream goes on from where the op left it.
    """
    if func in UPDATED_ARGS:
        # A recompute must not update the running statistics a second time.
        positions, names = UPDATED_ARGS[func]
        args = tuple(a.clone() if i in positions and isinstance(a, Tensor) else a for i, a in enumerate(args))
        kwargs = {k: v.clone() if k in names and isinstance(v, Tensor) else v for k, v in kwargs.items()}
    args = tuple(cast(a, torch.float32) for a in args)
    # never in place: an fp32 input is its own cast, and ``F.relu(x, inplace=True)`` again would change the caller's x
    kwargs = {k: False if k == "inplace" else cast(v, torch.float32) for k, v in kwargs.items()}
    after = rng_state()
    set_rng_state(rng)
    try:
        # outside dispatch modes: a selective activation checkpoint around the op would cache this run too
        with torch.no_grad(), autocast_off(), outside_dispatch_modes():
            return func(*args, **kwargs)
    except Exception:  # an op that only exists for its low-precision inputs: no reference, no error figure
        return None
    finally:
        set_rng_state(after)


@dataclass
class CensusRow:
    """One census row: an op class in one dtype, decided by a class rule or by a module override."""

    op_class: str
    dtype: str
    override: bool
    calls: int
    absmax: float
    #: bits from the dtype's largest finite value (fp16 only: bf16 has fp32's range, so it says nothing there)
    headroom_bits: float | None
    #: ``||out - ref|| / ||ref||`` against an fp32 recompute of the same ops on the same inputs (16-bit rows)
    rel_error: float | None
    #: fraction of output elements that are zero or subnormal where the fp32 recompute is not zero (16-bit rows)
    underflow_frac: float | None


class Census:
    """Per (op class, dtype, module override?): calls, peak magnitude and, against fp32 recomputes, error and underflow.

    Everything accumulates in device tensors; :meth:`rows` reads them all with one host sync.

    Example:
        >>> census = Census()
        >>> x = torch.tensor([1.0, 1e-6, 3.0])
        >>> census.record("pointwise", x.half(), False, ref=x)
        >>> row = census.rows()[0]
        >>> row.dtype, row.calls, round(row.underflow_frac, 3)  # 1e-6 is subnormal in fp16
        ('fp16', 1, 0.333)
    """

    def __init__(self) -> None:
        self.calls: dict[tuple[str, torch.dtype, bool], int] = {}
        self._sums: dict[tuple[str, torch.dtype, bool], Tensor] = {}  # [absmax, err², ref², underflow, numel]
        self._checked: set[tuple[str, torch.dtype, bool]] = set()

    def wants_reference(self, out: Any) -> bool:
        """Whether an fp32 recompute of the op that produced ``out`` would add anything (a 16-bit output)."""
        return any(t.dtype in LOW for t in local_floats(out))

    def record(self, cls: str, out: Any, override: bool, ref: Any = None) -> None:
        """Count one op's output; with ``ref`` (its fp32 recompute), also its error and underflow.

        Args:
            cls: the op's class.
            out: what the op returned.
            override: whether a module override, not the class rule, decided its dtype.
            ref: the fp32 recompute of the op, or ``None``.
        """
        with torch.no_grad():  # bookkeeping: inside an activation checkpoint, nothing here may be saved for backward
            self._record(cls, out, override, local_floats(ref) if ref is not None else [])

    def record_as(self, cls: str, dtype: torch.dtype, out: Any, override: bool, ref: Any) -> None:
        """Count one op that ran in ``dtype`` inside (a float8 GEMM: its output is in a wider dtype), with its error.

        Example:
            >>> census = Census()
            >>> census.record_as("matmul", torch.float8_e4m3fn, torch.ones(2), False, ref=torch.ones(2) * 1.01)
            >>> row = census.rows()[0]
            >>> row.dtype, round(row.rel_error, 4)
            ('fp8', 0.0099)
        """
        with torch.no_grad():
            self._record(cls, out, override, local_floats(ref), ran_in=dtype)

    def _record(self, cls: str, out: Any, override: bool, refs: list[Tensor],
                ran_in: torch.dtype | None = None) -> None:
        for i, t in enumerate(local_floats(out)):
            key = (cls, ran_in or t.dtype, override)
            self.calls[key] = self.calls.get(key, 0) + 1
            t = t.detach()
            peak = t.abs().amax().float()
            zero = peak.new_zeros(())
            err = ref2 = under = zero
            r = refs[i] if i < len(refs) and refs[i].shape == t.shape else None
            if r is not None and (t.dtype in LOW or ran_in is not None):
                r = r.float()
                o = t.float()
                finite = r.isfinite() & o.isfinite()
                err = torch.where(finite, o - r, 0).square().sum()
                ref2 = torch.where(finite, r, 0).square().sum()
                under = ((r != 0) & (o.abs() < torch.finfo(t.dtype).tiny)).sum().float()
                self._checked.add(key)
            numel = peak.new_full((), float(t.numel()) if r is not None else 0.0)
            step = torch.stack([peak, err, ref2, under, numel])
            prev = self._sums.get(key)
            if prev is None:
                self._sums[key] = step
            else:
                self._sums[key] = torch.cat([torch.maximum(prev[:1], step[:1]), prev[1:] + step[1:]])

    def rows(self) -> list[CensusRow]:
        """The rows, riskiest first (largest relative error, then most calls); one host sync for all of them."""
        keys = list(self._sums)
        if not keys:
            return []
        sums = torch.stack([self._sums[k] for k in keys]).cpu().tolist()
        rows = []
        for (cls, dtype, override), (peak, err, ref2, under, numel) in zip(keys, sums):
            headroom = None
            if dtype == torch.float16:
                fmax = torch.finfo(dtype).max
                headroom = math.inf if peak == 0 else (-math.inf if not math.isfinite(peak) else math.log2(fmax / peak))
            checked = (cls, dtype, override) in self._checked and numel > 0
            rel = math.sqrt(err / ref2) if checked and ref2 > 0 else (0.0 if checked else None)
            rows.append(CensusRow(cls, short_name(dtype), override, self.calls[(cls, dtype, override)], peak,
                                  headroom, rel, under / numel if checked else None))
        rows.sort(key=lambda r: (-(r.rel_error if r.rel_error is not None else -1.0), -r.calls, r.op_class))
        return rows


def merge_rows(rows: list[CensusRow], by: Callable[[CensusRow], Any]) -> dict[Any, dict[str, Any]]:
    """Census rows merged by a key: per op class, or per class and dtype.

    Calls are summed; the largest |output|, the worst error and underflow and the least fp16 headroom are kept
    (``None`` where no row had one), and whether any row was decided by a module override.

    Args:
        rows: :meth:`Census.rows`.
        by: the key to merge on, for example ``lambda r: r.op_class``.
    """
    out: dict[Any, dict[str, Any]] = {}
    for r in rows:
        entry = out.setdefault(by(r), {"calls": 0, "absmax": 0.0, "rel_error": None, "underflow_frac": None,
                                       "headroom_bits": None, "override": False})
        entry["calls"] += r.calls
        entry["absmax"] = max(entry["absmax"], r.absmax)
        entry["override"] = entry["override"] or r.override
        for name, pick in (("rel_error", max), ("underflow_frac", max), ("headroom_bits", min)):
            value = getattr(r, name)
            if value is not None:
                entry[name] = value if entry[name] is None else pick(entry[name], value)
    return out


#: fp16 outputs closer than this many bits to finfo(fp16).max are warned about
WARN_BITS = 4.0


def near_overflow(rows: list[CensusRow]) -> list[CensusRow]:
    """The fp16 rows within :data:`WARN_BITS` of overflow."""
    return [r for r in rows if r.headroom_bits is not None and r.headroom_bits < WARN_BITS]


def census_markdown(rows: list[CensusRow], table: dict[str, str]) -> str:
    """``opkit/precision/census``: one row per class and dtype, what decided it, its error, underflow, headroom.

    Args:
        rows: the census rows.
        table: the policy's class rules (op class -> dtype name).
    """
    def sci(value: float | None) -> str:
        return "-" if value is None else f"{value:.2e}"

    text = markdown_table(
        ["op class", "ran in", "decided by", "calls", "rel. error vs fp32", "underflow frac", "max abs output",
         "fp16 headroom bits"],
        [[r.op_class, r.dtype, "module override" if r.override else f"class rule ({table[r.op_class]})", r.calls,
          sci(r.rel_error), sci(r.underflow_frac), r.absmax, "-" if r.headroom_bits is None else r.headroom_bits]
         for r in rows])
    near = near_overflow(rows)
    if near:
        text += "\n\n**Near overflow:** " + ", ".join(f"{r.op_class} in fp16 ({r.headroom_bits:.1f} bits)"
                                                      for r in near)
    return text
