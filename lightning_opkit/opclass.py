"""The operator-class taxonomy shared by every opkit callback.

One table maps three views of the same operator to one class:

* Python-level torch functions and Tensor methods, as a ``TorchFunctionMode`` sees them
  (``F.linear``, ``torch.matmul``, ``Tensor.__matmul__``, ``F.softmax``, ...);
* ``nn.Module`` types (``nn.Linear``, ``nn.LayerNorm``, ...);
* profiler event names (``aten::addmm``, ``aten::_softmax``, ``MmBackward0``, ...).

Anything unknown is ``"other"``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from lightning_opkit.core.torch_compat import ConvNd, DropoutNd, Loss, NormBase

__all__ = [
    "GEMM_CLASSES",
    "GOVERNED",
    "NEVER_CAST",
    "NO_ARITHMETIC",
    "OP_CLASSES",
    "classify_function",
    "classify_module",
    "classify_name",
    "classify_profiler_event",
    "function_info",
    "fused_kernel_class",
    "fused_kernel_ops",
    "is_framework_event",
    "is_inplace",
]

OP_CLASSES: tuple[str, ...] = (
    "matmul",
    "conv",
    "attention",
    "norm",
    "softmax",
    "activation",
    "loss",
    "reduction",
    "pointwise",
    "embedding",
    "rnn",
    "copy",
    "layout",
    "communication",
    "other",
)

# The groups every callback reads the same way.

#: classes whose ops are GEMMs: the work 16-bit units (Tensor Cores, AMX, AVX512-BF16) speed up, and the model's FLOPs
#: in MFU (everything else is a rounding error beside them)
GEMM_CLASSES: tuple[str, ...] = ("matmul", "conv", "attention", "rnn")
#: classes that do no arithmetic of their own: dispatch, views and allocations, collectives
NO_ARITHMETIC: tuple[str, ...] = ("other", "layout", "communication")
#: classes a precision policy never casts: no arithmetic, and casts and copies (casting their input first would change
#: what they produce)
NEVER_CAST: tuple[str, ...] = ("other", "copy", "layout", "communication")
#: the classes a precision policy decides the dtype of
GOVERNED: tuple[str, ...] = tuple(c for c in OP_CLASSES if c not in NEVER_CAST)

_NAMES: dict[str, tuple[str, ...]] = {
    # c10d, gloo and NCCL collectives and point-to-point ops, as torch.distributed, funcol and the profiler name them
    # (never ``gather``/``scatter``/``reduce`` alone: those are tensor ops too)
    "communication": (
        "all_reduce", "allreduce", "allreduce_coalesced", "all_gather", "allgather", "_allgather_base",
        "all_gather_into_tensor", "allgather_into_tensor_coalesced", "all_gather_into_tensor_coalesced",
        "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
        "broadcast", "send", "recv", "recv_any_source", "barrier", "all_to_all", "alltoall", "alltoall_base",
        "all_to_all_single", "wait_tensor", "record_param_comms",
    ),
    "matmul": (
        "linear", "addmm", "mm", "bmm", "matmul", "einsum", "baddbmm", "addbmm", "addmv", "mv", "dot",
        "vdot", "inner", "outer", "tensordot", "bilinear", "chain_matmul", "multi_dot", "_addmm_activation",
        "mkldnn_linear", "_mkldnn_linear", "_int_mm", "_scaled_mm", "rmatmul",
        # Mixture-of-Experts: every expert's GEMM in one call, rows grouped by expert offsets (most of an MoE's FLOPs)
        "_grouped_mm", "grouped_mm", "_scaled_grouped_mm", "scaled_grouped_mm",
    ),
    "conv": (
        "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "mkldnn_convolution", "cudnn_convolution", "slow_conv2d_forward",
        "_slow_conv2d_forward", "slow_conv3d_forward", "thnn_conv2d", "conv_depthwise2d",
        "_conv_depthwise2d", "convolution_overrideable", "conv_tbc", "slow_conv_transpose2d", "slow_conv2d",
        "_slow_conv2d", "slow_conv3d", "slow_conv_dilated2d", "slow_conv_dilated3d", "slow_conv_transpose3d",
        "_nnpack_spatial_convolution", "mkldnn_convolution_backward", "cudnn_convolution_transpose",
    ),
    "attention": (
        "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math", "_flash_attention_forward",
        "_efficient_attention_forward", "_fused_sdp_choice", "multi_head_attention_forward",
        "_native_multi_head_attention", "flex_attention",
        # the ops under scaled_dot_product_attention that launch its kernels on CUDA, forward and (by their
        # ``_backward`` suffix) backward
        "_flash_attention", "_efficient_attention", "_cudnn_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_varlen", "flash_attention",
    ),
    "norm": (
        "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "batch_norm", "native_batch_norm",
        "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "_batch_norm_impl_index",
        "cudnn_batch_norm", "miopen_batch_norm", "_batch_norm_with_update", "_batch_norm_no_update",
        "instance_norm", "rms_norm", "_fused_rms_norm", "local_response_norm", "normalize", "weight_norm",
        "_weight_norm", "_weight_norm_interface",
    ),
    "softmax": ("softmax", "_softmax", "log_softmax", "_log_softmax", "softmin", "_safe_softmax", "gumbel_softmax"),
    "activation": (
        "relu", "relu6", "gelu", "silu", "sigmoid", "tanh", "leaky_relu", "elu", "selu", "celu", "mish",
        "hardswish", "hardsigmoid", "hardtanh", "softplus", "softsign", "prelu", "_prelu_kernel", "rrelu",
        "glu", "logsigmoid", "log_sigmoid", "log_sigmoid_forward", "threshold", "tanhshrink", "softshrink",
        "hardshrink", "swish",
    ),
    "loss": (
        "cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "nll_loss_forward",
        "nll_loss2d_forward", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
        "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss", "gaussian_nll_loss", "ctc_loss",
        "_ctc_loss", "margin_ranking_loss", "hinge_embedding_loss", "multilabel_margin_loss",
        "soft_margin_loss", "multilabel_soft_margin_loss", "cosine_embedding_loss", "multi_margin_loss",
        "triplet_margin_loss", "triplet_margin_with_distance_loss",
    ),
    "reduction": (
        "sum", "mean", "nansum", "nanmean", "var", "std", "var_mean", "std_mean", "norm", "linalg_vector_norm",
        "vector_norm", "matrix_norm", "frobenius_norm", "amax", "amin", "aminmax", "max", "min", "prod",
        "logsumexp", "cumsum", "cumprod", "logcumsumexp", "argmax", "argmin", "median", "nanmedian", "mode",
        "all", "any", "count_nonzero", "_foreach_norm",
        # accumulations into picked rows: an MoE's combine of expert outputs (their sums round like any reduction's)
        "index_add", "scatter_add", "scatter_reduce", "index_reduce",
    ),
    "pointwise": (
        "add", "sub", "subtract", "rsub", "mul", "multiply", "div", "divide", "true_divide", "floor_divide",
        "truediv", "floordiv", "rtruediv", "rfloordiv", "radd", "rmul", "remainder", "fmod", "mod", "pow", "rpow",
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "neg", "negative", "abs",
        "square", "reciprocal", "sign", "clamp", "clip", "clamp_min", "clamp_max", "where", "maximum",
        "minimum", "fmax", "fmin", "lerp", "addcmul", "addcdiv", "sin", "cos", "tan", "erf", "erfc", "erfinv",
        "floor", "ceil", "round", "trunc", "frac", "masked_fill", "dropout", "native_dropout", "feature_dropout",
        "alpha_dropout", "bernoulli", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
        "logical_not", "isfinite", "isnan", "isinf", "nan_to_num", "xlogy", "hypot", "atan2", "lgamma",
        "digamma", "mvlgamma", "heaviside", "copysign", "invert", "and", "or", "xor", "tril", "triu",
        "greater", "greater_equal", "less", "less_equal", "not_equal", "diff",
    ),
    "embedding": ("embedding", "embedding_dense", "embedding_bag", "_embedding_bag", "embedding_renorm", "one_hot"),
    "rnn": (
        "lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
        "mkldnn_rnn_layer", "mkldnn_rnn", "_cudnn_rnn", "cudnn_rnn", "miopen_rnn", "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell", "quantized_lstm", "quantized_gru", "lstm_mps",
    ),
    # Casts and copies: data movement, never cast by the precision policy (that would change what they produce).
    "copy": (
        "copy", "_to_copy", "to", "clone", "contiguous", "_copy_from", "_copy_from_and_resize", "type_as",
        "cat", "stack", "_foreach_copy", "double", "float", "half", "bfloat16",
        # FSDP2's copies into and out of its all-gather and reduce-scatter buffers
        "all_gather_copy_in", "split_with_sizes_copy", "chunk_cat", "_chunk_cat",
    ),
    # Views, reshapes and allocations: no arithmetic, but on small models their dispatch time shows in profiles.
    "layout": (
        "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "transpose", "t", "permute", "expand",
        "expand_as", "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "narrow",
        "unbind", "flatten", "unflatten", "detach", "alias", "lift_fresh", "resolve_conj", "resolve_neg",
        "empty", "empty_strided", "empty_like", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
        "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "arange", "view_as", "movedim",
        "swapaxes", "contiguous_format", "index_select", "gather", "scatter", "index", "index_put", "repeat",
        "repeat_interleave", "roll", "flip", "pad", "constant_pad_nd", "tensor_split", "diagonal", "tile",
        # Mixture-of-Experts routing: which expert each token goes to, and the tokens sorted and counted by expert.
        # Selection and movement, no arithmetic a dtype changes (a cast before topk could only change the choice)
        "topk", "sort", "argsort", "msort", "histc", "bincount", "nonzero", "nonzero_static", "unique", "_unique2",
        "unique_consecutive", "searchsorted", "bucketize", "masked_select", "masked_scatter", "index_copy",
        "_index_put_impl", "nonzero_numpy", "value_selecting_reduction_backward", "linspace", "logspace",
        # writes of a constant and resizes: the allocations' kin (``zero_`` on gradients, ``fill_`` of a new buffer)
        "fill", "zero", "resize", "resize_as",
    ),
}

_NAME_TO_CLASS: dict[str, str] = {name: cls for cls, names in _NAMES.items() for name in names}

_MODULE_TYPES: tuple[tuple[tuple[type[nn.Module], ...], str], ...] = (
    ((nn.Linear, nn.Bilinear, nn.LazyLinear), "matmul"),
    ((ConvNd,), "conv"),
    ((nn.MultiheadAttention,), "attention"),
    (
        (
            nn.LayerNorm, nn.GroupNorm, NormBase, nn.LocalResponseNorm,
            *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
        ),
        "norm",
    ),
    ((nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d), "softmax"),
    (
        (
            nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU,
            nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Softsign, nn.PReLU, nn.RReLU,
            nn.GLU, nn.LogSigmoid, nn.Threshold, nn.Tanhshrink, nn.Softshrink, nn.Hardshrink,
        ),
        "activation",
    ),
    ((Loss,), "loss"),
    ((nn.Embedding, nn.EmbeddingBag), "embedding"),
    ((nn.RNNBase, nn.RNNCellBase), "rnn"),
    ((DropoutNd,), "pointwise"),
)

# Autograd nodes in profiler traces are CamelCase with a version suffix: ``NativeLayerNormBackward0``.
_AUTOGRAD_NODE = re.compile(r"^(?:autograd::engine::evaluate_function: )?([A-Za-z0-9]+?)Backward\d*$")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
# a library's "<op>_fallback" is that op by another implementation (transformers' grouped_mm_fallback, which it runs
# under torch.compile for fp32 weights)
_SUFFIXES = ("_backward_data", "_backward_input", "_backward_weight", "_backward", "_forward", "_out", "_fallback")


def _normalize(name: str) -> str:
    name = name.strip()
    if "::" in name:
        name = name.rsplit("::", 1)[1]
    name = name.split(".", 1)[0]  # overload, as in ``addmm.default``
    dunder = name.startswith("__") and name.endswith("__")
    name = name.strip("_") if dunder else name
    if name.startswith("i") and dunder and name[1:] in _NAME_TO_CLASS:
        name = name[1:]  # ``__iadd__`` is in-place ``add``
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return name


def _classify_plain(name: str) -> str:
    # Only dict lookups and str methods on constants: dynamo folds these while tracing, with no guards to fail.
    base = _normalize(name)
    cls = _NAME_TO_CLASS.get(base) or _NAME_TO_CLASS.get("_" + base)
    if cls is not None:
        return cls
    for suffix in _SUFFIXES:
        if base.endswith(suffix) and len(base) > len(suffix):
            cls = _classify_plain(base[: -len(suffix)])  # suffixes stack: grouped_mm_fallback_backward
            if cls != "other":
                return cls
    if base.startswith("_foreach_"):
        return _NAME_TO_CLASS.get(base[len("_foreach_") :], "other")
    return "other"


def classify_name(name: str) -> str:
    """Classify an operator by name: a torch function, a Tensor method, an aten op or an autograd node.

    Args:
        name: for example ``"linear"``, ``"__matmul__"``, ``"aten::native_layer_norm"``, ``"MmBackward0"``.

    Example:
        >>> classify_name("aten::_softmax"), classify_name("NativeLayerNormBackward0")
        ('softmax', 'norm')
    """
    node = _AUTOGRAD_NODE.match(name.strip())
    if node:
        name = _CAMEL.sub("_", node.group(1)).lower()
    return _classify_plain(name)


_FUNCTION_CACHE: dict[Any, tuple[str, bool]] = {}


def _function_name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", None)
    if name is None or name == "__get__":
        # Properties such as ``Tensor.shape`` arrive as their ``__get__``: never compute.
        return ""
    return name


def classify_function(func: Callable[..., Any]) -> str:
    """Classify a callable as a ``TorchFunctionMode`` receives it (``F.linear``, ``Tensor.__matmul__``, ...).

    Args:
        func: the ``func`` argument of ``__torch_function__``.

    Example:
        >>> import torch
        >>> classify_function(torch.nn.functional.gelu), classify_function(torch.Tensor.__matmul__)
        ('activation', 'matmul')
    """
    return function_info(func)[0]


# What a module runs, strongest first: a block that calls a GEMM and a GELU is a GEMM.
_RUN_ORDER = ("attention", "conv", "matmul", "rnn", "embedding", "norm", "loss", "softmax", "activation")
# Hand-written modules whose ops alone say little (an RMSNorm is pow, mean, rsqrt, mul), by their class name.
_NAME_HINTS = (
    (re.compile(r"norm", re.I), "norm"),
    (re.compile(r"attention|attn", re.I), "attention"),
    (re.compile(r"embed", re.I), "embedding"),
    (re.compile(r"loss", re.I), "loss"),
    (re.compile(r"gelu|relu|silu|swish|mish|activation", re.I), "activation"),
)


def classify_module(module: nn.Module, ops: Mapping[str, int] | None = None) -> str:
    """Classify an ``nn.Module``: by its ``torch.nn`` type, else by the ops it ran itself, else by its class (name).

    Args:
        module: any module.
        ops: op class -> calls made directly inside this module (not in its submodules), when known; a module of a
            library opkit does not know (Hugging Face's ``Conv1D`` runs ``addmm``) is then classified by what it ran.

    Example:
        >>> from torch import nn
        >>> classify_module(nn.LayerNorm(4)), classify_module(nn.Sequential())
        ('norm', 'other')
        >>> class Conv1D(nn.Module): ...
        >>> class LlamaRMSNorm(nn.Module): ...
        >>> classify_module(Conv1D(), {"matmul": 1, "copy": 2}), classify_module(LlamaRMSNorm())
        ('matmul', 'norm')
    """
    for types, cls in _MODULE_TYPES:
        if isinstance(module, types):
            return cls
    if ops:
        for cls in _RUN_ORDER:
            if ops.get(cls):
                return cls
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    if name == "Conv1D" and isinstance(weight, nn.Parameter) and weight.dim() == 2:
        return "matmul"  # Hugging Face's Conv1D (GPT-2) is a Linear with its weight transposed: a 2-D weight, an addmm
    for pattern, cls in _NAME_HINTS:
        if pattern.search(name):
            return cls
    return "other"


def classify_profiler_event(name: str) -> str:
    """Classify a profiler event name (``aten::addmm``, ``MmBackward0``); record-function spans are ``"other"``.

    Args:
        name: the event's ``key`` / ``name`` as in ``prof.key_averages()`` or a Chrome trace.

    Example:
        >>> classify_profiler_event("aten::convolution_backward")
        'conv'
    """
    if is_framework_event(name):
        return "other"
    if _COMMUNICATION.match(name):
        return "communication"
    fused = fused_kernel_ops(name)
    if fused is not None:
        return fused_kernel_class(fused)
    if name.endswith("AccumulateGrad"):  # ``torch::autograd::AccumulateGrad``: adds a gradient into ``.grad``
        return "pointwise"
    return classify_name(name)


_FUSED = re.compile(r"^(?:graph_\d+_)?(?:cpp_fused|triton_(?:poi|red|per|tem|for|mm|bmm|convolution)(?:_fused)?)"
                    r"_?(.*?)(?:_\d+)?$")
# A fused kernel gets the class of its dominant op: the strongest by this order.
_FUSED_ORDER = ("attention", "conv", "matmul", "rnn", "loss", "norm", "softmax", "embedding", "activation",
                "reduction", "pointwise", "copy", "layout")


def fused_kernel_ops(name: str) -> list[str] | None:
    """The ops an Inductor fused kernel (``cpp_fused_*`` on CPU, ``triton_*`` on GPU) fuses, from its name.

    Args:
        name: a profiler event or kernel name.

    Returns:
        The op names found in it, in order, or ``None`` when ``name`` is not an Inductor fused kernel.

    Example:
        >>> fused_kernel_ops("cpp_fused__log_softmax__to_copy_nll_loss_forward_3")
        ['log_softmax', 'to_copy', 'nll_loss_forward']
        >>> fused_kernel_ops("triton_poi_fused_add_gelu_0"), fused_kernel_ops("aten::add")
        (['add', 'gelu'], None)
        >>> fused_kernel_ops("graph_0_cpp_fused_add_native_layer_norm_view_4")  # as Inductor's kernel profile names it
        ['add', 'native_layer_norm', 'view']
    """
    match = _FUSED.match(name.strip())
    if match is None:
        return None
    tokens = [t for t in match.group(1).split("_") if t]
    ops, i = [], 0
    while i < len(tokens):
        for j in range(len(tokens), i, -1):  # the longest run of tokens that names an op
            candidate = "_".join(tokens[i:j])
            if _classify_plain(candidate) != "other":
                ops.append(candidate)
                i = j
                break
        else:
            i += 1
    return ops


def fused_kernel_class(ops: list[str]) -> str:
    """The class of a fused kernel: that of its dominant op (see :func:`fused_kernel_ops`).

    Args:
        ops: the op names it fuses.

    Example:
        >>> fused_kernel_class(["add", "gelu"]), fused_kernel_class(["native_layer_norm", "view"])
        ('activation', 'norm')
    """
    classes = {_classify_plain(op) for op in ops}
    return next((cls for cls in _FUSED_ORDER if cls in classes), "other")


# Spans that hold Python time of the training loop, not operators: the profiler step, the optimizer step (which in
# Lightning holds the whole closure's Python time), data loading.
# Backend events (``gloo:all_gather``, ``nccl:all_reduce``, c10d's ``record_param_comms``) and FSDP2's spans around its
# collectives; FSDP2's other spans (pre_forward, reshard, ...) hold ops of their own and stay "other".
_COMMUNICATION = re.compile(r"^(gloo:|nccl:|ncclDevKernel|ncclKernel|record_param_comms|c10d::|_c10d_functional::|"
                            r"c10d_functional::|FSDP::all_gather( |$)|FSDP::post_backward_reduce|"
                            r"FSDP::post_backward_rs_wait)")
_FRAMEWORK = re.compile(r"^(ProfilerStep#|ProfilerStep\*|Optimizer\.|enumerate\(DataLoader\)|_\w*DataLoaderIter|\[pl\]|"
                        r"cudaDeviceSynchronize|cudaStreamSynchronize|"
                        # compiled code's own Python: the region span opkit opens, Inductor's graph-call span,
                        # dynamo's cache lookup; the kernels inside them are events of their own
                        r"opkit region |## Call CompiledFxGraph|CompiledFunction|TorchDynamo Cache Lookup|"
                        r"Torch-Compiled Region|"
                        # compilation itself, when a window catches a (re)compile
                        r".*\(dynamo_timed\)$|PythonDispatchMode$|PythonSubclass$|dynamo$)")


def is_framework_event(name: str) -> bool:
    """Whether a profiler event is a framework span (profiler step, optimizer step, data loading), not an operator.

    Its self time is the loop's Python overhead: reported apart, never mixed into the op-class shares.

    Args:
        name: the event's key.

    Example:
        >>> is_framework_event("Optimizer.step#AdamW.step"), is_framework_event("aten::mm")
        (True, False)
    """
    return _FRAMEWORK.match(name) is not None


def function_info(func: Callable[..., Any]) -> tuple[str, bool]:
    """``(op class, in-place?)`` of a torch function, cached per function object (one dict access when hot).

    Args:
        func: the ``func`` argument of ``__torch_function__``.

    Example:
        >>> import torch
        >>> function_info(torch.Tensor.add_)
        ('pointwise', True)
    """
    try:
        return _FUNCTION_CACHE[func]
    except KeyError:
        pass
    except TypeError:  # unhashable callables
        return _uncached_info(func)
    info = _FUNCTION_CACHE[func] = _uncached_info(func)
    return info


def _uncached_info(func: Callable[..., Any]) -> tuple[str, bool]:
    name = _function_name(func)
    return (_classify_plain(name) if name else "other"), is_inplace(func)


def is_inplace(func: Callable[..., Any]) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``__iadd__``), so its inputs must not be cast.

    Args:
        func: a torch function or Tensor method.

    Example:
        >>> import torch
        >>> is_inplace(torch.Tensor.add_), is_inplace(torch.Tensor.add)
        (True, False)
    """
    name = getattr(func, "__name__", "") or ""
    if name.startswith("__") and name.endswith("__"):
        return name.startswith("__i") and name[3:-2] in _NAME_TO_CLASS
    return name.endswith("_") or name in ("__setitem__", "copy_")
