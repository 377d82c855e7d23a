import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_opkit.opclass import (
    OP_CLASSES,
    classify_function,
    classify_module,
    classify_name,
    classify_profiler_event,
)

# (callable that runs the op, expected class, nn.Module doing it or None)
x4 = torch.randn(2, 3, 4)
CASES = {
    "linear": (lambda: F.linear(x4, torch.randn(5, 4)), "matmul", nn.Linear(4, 5)),
    "matmul": (lambda: torch.matmul(x4, torch.randn(4, 2)), "matmul", None),
    "bmm": (lambda: torch.bmm(x4, torch.randn(2, 4, 3)), "matmul", None),
    "einsum": (lambda: torch.einsum("bij,jk->bik", x4, torch.randn(4, 2)), "matmul", None),
    "@": (lambda: x4 @ torch.randn(4, 2), "matmul", None),
    "conv1d": (lambda: F.conv1d(torch.randn(1, 2, 8), torch.randn(3, 2, 3)), "conv", nn.Conv1d(2, 3, 3)),
    "conv2d": (lambda: F.conv2d(torch.randn(1, 2, 8, 8), torch.randn(3, 2, 3, 3)), "conv", nn.Conv2d(2, 3, 3)),
    "sdpa": (lambda: F.scaled_dot_product_attention(x4, x4, x4), "attention", nn.MultiheadAttention(4, 1)),
    "layer_norm": (lambda: F.layer_norm(x4, (4,)), "norm", nn.LayerNorm(4)),
    "group_norm": (lambda: F.group_norm(torch.randn(2, 4, 3), 2), "norm", nn.GroupNorm(2, 4)),
    "batch_norm": (lambda: F.batch_norm(torch.randn(4, 3), None, None, training=True), "norm", nn.BatchNorm1d(3)),
    "rms_norm": (lambda: F.rms_norm(x4, (4,)), "norm", nn.RMSNorm(4)),
    "softmax": (lambda: F.softmax(x4, -1), "softmax", nn.Softmax(-1)),
    "log_softmax": (lambda: F.log_softmax(x4, -1), "softmax", nn.LogSoftmax(-1)),
    "gelu": (lambda: F.gelu(x4), "activation", nn.GELU()),
    "relu": (lambda: F.relu(x4), "activation", nn.ReLU()),
    "silu": (lambda: F.silu(x4), "activation", nn.SiLU()),
    "cross_entropy": (lambda: F.cross_entropy(torch.randn(3, 4), torch.tensor([0, 1, 2])), "loss",
                      nn.CrossEntropyLoss()),
    "mse": (lambda: F.mse_loss(x4, x4 * 2), "loss", nn.MSELoss()),
    "sum": (lambda: x4.sum(), "reduction", None),
    "mean": (lambda: torch.mean(x4), "reduction", None),
    "var": (lambda: x4.var(-1), "reduction", None),
    "embedding": (lambda: F.embedding(torch.tensor([0, 1]), torch.randn(3, 4)), "embedding", nn.Embedding(3, 4)),
    "add": (lambda: x4 + 1, "pointwise", None),
    "mul": (lambda: torch.mul(x4, 2), "pointwise", nn.Dropout()),
}


class _Seen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(CASES))
def test_function_view_as_torch_function_mode_sees_it(name):
    run, expected, _ = CASES[name]
    with _Seen() as seen:
        run()
    classes = [classify_function(f) for f in seen.funcs]
    assert expected in classes, (name, seen.funcs, classes)
    # The first call the mode sees is the op itself (tensor creation is excluded by running args eagerly above).
    assert classes[-1] == expected or expected in classes


@pytest.mark.parametrize("name", list(CASES))
def test_profiler_view_of_forward_and_backward(name):
    run, expected, _ = CASES[name]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    classes = {classify_profiler_event(e.key) for e in prof.key_averages()}
    assert expected in classes, (name, [e.key for e in prof.key_averages()])


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] is not None])
def test_module_view(name):
    _, expected, module = CASES[name]
    assert classify_module(module) == expected


@pytest.mark.parametrize(
    "event, expected",
    [
        ("aten::addmm", "matmul"), ("aten::mm", "matmul"), ("aten::_softmax", "softmax"),
        ("aten::native_layer_norm", "norm"), ("aten::native_layer_norm_backward", "norm"),
        ("aten::_softmax_backward_data", "softmax"), ("aten::convolution_backward", "conv"),
        ("aten::gelu_backward", "activation"), ("aten::threshold_backward", "activation"),
        ("aten::nll_loss_forward", "loss"), ("aten::embedding_dense_backward", "embedding"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("NativeLayerNormBackward0", "norm"), ("MmBackward0", "matmul"), ("LogSoftmaxBackward0", "softmax"),
        ("autograd::engine::evaluate_function: AddmmBackward0", "matmul"), ("aten::add_", "pointwise"),
        ("aten::view", "layout"), ("ProfilerStep#3", "other"), ("Optimizer.step#AdamW.step", "other"),
        ("aten::_foreach_mul_", "pointwise"),
    ],
)
def test_profiler_names(event, expected):
    assert classify_profiler_event(event) == expected


def test_backward_ops_are_classified_from_a_real_trace():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        F.cross_entropy(model(torch.randn(5, 4)), torch.tensor([0, 1, 2, 0, 1])).backward()
    keys = {e.key: classify_profiler_event(e.key) for e in prof.key_averages()}
    assert {"matmul", "norm", "activation", "loss", "softmax"} <= set(keys.values())
    assert keys.get("aten::native_layer_norm_backward") == "norm"


def test_every_class_is_known_and_unknown_is_other():
    assert OP_CLASSES[-1] == "other"
    assert len(set(OP_CLASSES)) == 15
    assert classify_name("definitely_not_an_op") == "other"
    assert classify_function(torch.Tensor.view) == "layout"
    assert classify_module(nn.Sequential()) == "other"


@pytest.mark.parametrize(
    "event, expected",
    [
        ("aten::_slow_conv2d_backward", "conv"),  # 83% of a bf16 ResNet's CPU time was "other"
        ("aten::_slow_conv2d_forward", "conv"),
        ("aten::mkldnn_rnn_layer", "rnn"),
        ("aten::lstm", "rnn"),
        ("aten::gru", "rnn"),
        ("MkldnnRnnLayerBackward0", "rnn"),
        ("aten::copy_", "copy"),
        ("aten::_to_copy", "copy"),
        ("aten::to", "copy"),
        ("aten::tril", "pointwise"),
        ("aten::triu", "pointwise"),
        ("graph_0_cpp_fused_add_native_layer_norm_view_4", "norm"),  # Inductor's fused kernels: the dominant op
        ("cpp_fused__log_softmax__to_copy_nll_loss_forward_3", "loss"),
        ("triton_poi_fused_add_gelu_0", "activation"),
        ("bytecode_tracing (dynamo_timed)", "other"),  # compilation: framework, not in the shares
    ],
)
def test_taxonomy_gaps_seen_in_real_profiles(event, expected):
    assert classify_profiler_event(event) == expected


def test_rnn_modules_and_ops_from_a_real_lstm_trace():
    lstm = nn.LSTM(4, 8, batch_first=True)
    assert classify_module(lstm) == classify_module(nn.GRUCell(4, 4)) == "rnn"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        lstm(torch.randn(2, 3, 4))[0].sum().backward()
    classes = {classify_profiler_event(e.key) for e in prof.key_averages() if "lstm" in e.key.lower()}
    assert classes == {"rnn"}, {e.key: classify_profiler_event(e.key) for e in prof.key_averages()}


def test_modules_opkit_does_not_know_are_classified_by_what_they_run_or_their_name():
    from zoo import build

    gpt2 = build("hf_gpt2").model
    llama = build("hf_llama").model
    conv1d = gpt2.get_submodule("transformer.h.0.mlp.c_fc")
    assert classify_module(conv1d) == "matmul"  # no torch.nn type, no ops seen: its 2-D weight says it is a GEMM
    assert classify_module(conv1d, {"matmul": 1, "copy": 2}) == "matmul"
    assert classify_module(llama.get_submodule("model.layers.0.input_layernorm")) == "norm"


@pytest.mark.parametrize("name", ["bytecode_tracing (dynamo_timed)", "PythonDispatchMode", "opkit region blocks.0",
                                  "## Call CompiledFxGraph fjsuuigafy57 ##", "Optimizer.step#AdamW.step",
                                  "ProfilerStep#3", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"])
def test_framework_spans_are_reported_apart(name):
    from lightning_opkit.opclass import is_framework_event

    assert is_framework_event(name)
    assert not is_framework_event("aten::mm")


def test_hugging_face_s_conv1d_is_a_gemm_as_the_dispatcher_sees_it():
    """GPT-2's Conv1D (a Linear with its weight transposed) was ``[other]`` in the named ranges. The observer: the
    aten ops it dispatches, which are a GEMM's."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.pytorch_utils import Conv1D

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    module = Conv1D(12, 8)
    with Ops():
        module(torch.randn(2, 8))
    assert torch.ops.aten.addmm.default in seen
    assert classify_module(module) == "matmul"
    assert classify_module(nn.Conv1d(2, 2, 3)) == "conv"  # torch's own is a convolution, by its type
