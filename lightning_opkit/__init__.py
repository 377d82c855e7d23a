"""lightning_opkit: PyTorch Lightning callbacks for operator-level training work.

One folder per callback, each over Trainer-free parts, on a shared core:

- :mod:`lightning_opkit.precision`: :class:`PrecisionPolicy`, the dtype of each operator class, measured and decided.
- :mod:`lightning_opkit.nan`: :class:`NaNDetector`, one cheap check per step; the first module named, the cause by
  replay, the step skipped with nothing lost.
- :mod:`lightning_opkit.profiler`: :class:`ProfilerWindows`, short profiler windows: time per op class, the roofline.
- :mod:`lightning_opkit.compile`: :class:`TorchCompile`, in-place and regional ``torch.compile``, reported.
- :mod:`lightning_opkit.checkpointing`: :class:`ActivationCheckpointing`, blocks recomputed in backward, full or
  selective by op class, its price measured.
- :mod:`lightning_opkit.opclass`: the one operator-class taxonomy every callback reads.
- :mod:`lightning_opkit.core`: what they share (the logging sink, the run summary, replays, ranks, timing, how a
  callback finds the others); it imports no feature.
"""

from lightning_opkit.checkpointing import ActivationCheckpointing
from lightning_opkit.checkpointing.activation_checkpointing import Price
from lightning_opkit.compile import TorchCompile
from lightning_opkit.compile.state_keys import strip_compile_prefix
from lightning_opkit.core.deprecations import OpkitDeprecationWarning
from lightning_opkit.core.replay import replaying
from lightning_opkit.core.select import find_blocks, module_names
from lightning_opkit.nan import NaNDetector, NonFiniteError
from lightning_opkit.nan.report import NaNReport
from lightning_opkit.opclass import OP_CLASSES, classify_function, classify_module, classify_name
from lightning_opkit.precision import PrecisionMeasurements, PrecisionPolicy, decide, measure_precision
from lightning_opkit.precision.decide import Decision
from lightning_opkit.precision.fp8 import Float8Linears
from lightning_opkit.precision.results import Measurement
from lightning_opkit.profiler import ProfilerWindows
from lightning_opkit.profiler.memory import MemoryReport
from lightning_opkit.profiler.op_times import WindowReport
from lightning_opkit.profiler.roofline.report import RooflineReport

# Grouped: the callbacks, the helpers, the types behind their public attributes and results.
__all__ = [  # noqa: RUF022 (grouped, not sorted)
    # callbacks
    "ActivationCheckpointing",
    "NaNDetector",
    "PrecisionPolicy",
    "ProfilerWindows",
    "TorchCompile",
    # helpers
    "OP_CLASSES",
    "classify_function",
    "classify_module",
    "classify_name",
    "decide",
    "find_blocks",
    "measure_precision",
    "module_names",
    "replaying",
    "strip_compile_prefix",
    # types
    "Decision",
    "Float8Linears",
    "Measurement",
    "MemoryReport",
    "NaNReport",
    "NonFiniteError",
    "OpkitDeprecationWarning",
    "PrecisionMeasurements",
    "Price",
    "RooflineReport",
    "WindowReport",
]

__version__ = "0.1.0"
