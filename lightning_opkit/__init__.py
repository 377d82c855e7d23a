"""lightning_opkit: PyTorch Lightning callbacks for operator-level training work."""

from lightning_opkit.compile import TorchCompile
from lightning_opkit.compile.checkpoints import strip_compile_prefix
from lightning_opkit.core.replay import replaying
from lightning_opkit.core.select import find_blocks, module_names
from lightning_opkit.nan import NaNDetector, NonFiniteError
from lightning_opkit.opclass import OP_CLASSES, classify_function, classify_module, classify_name
from lightning_opkit.precision import PrecisionMeasurements, PrecisionPolicy, decide, measure_precision
from lightning_opkit.profiler import ProfilerWindows

__all__ = [
    "OP_CLASSES",
    "NaNDetector",
    "NonFiniteError",
    "PrecisionMeasurements",
    "PrecisionPolicy",
    "ProfilerWindows",
    "TorchCompile",
    "classify_function",
    "classify_module",
    "classify_name",
    "decide",
    "find_blocks",
    "measure_precision",
    "module_names",
    "replaying",
    "strip_compile_prefix",
]

__version__ = "0.1.0"
