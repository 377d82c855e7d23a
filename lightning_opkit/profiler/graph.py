"""The model's graph for TensorBoard's Graphs tab, from ``torch.export``: every op under its module's path.

``SummaryWriter.add_graph`` traces with ``torch.jit.trace``, which torch deprecates, runs the model for real (a
BatchNorm's statistics move, the RNG advances) and names nodes after TorchScript's scopes. Here the graph comes from
``torch.export.export(..., strict=False)``, which runs the forward on fake tensors: the model's weights, buffers and
the RNG are untouched. Each op becomes a node named ``<module path>/<op>`` (``model/blocks/0/attn/qkv/linear``), so the
Graphs tab folds the model by module as TensorBoard's other opkit views name it; parameters sit in their module's
scope, the inputs under ``input/``. Each node carries its output shape and dtype, and its op class.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from lightning_opkit.core.dtypes import full_name
from lightning_opkit.opclass import classify_profiler_event

__all__ = ["draw_graph", "example_inputs", "export_graph", "graph_def"]


def example_inputs(model: nn.Module, batch: Any) -> list[tuple[str, tuple, dict]]:
    """The calls worth trying to draw ``model``'s graph with, best first: ``(what, args, kwargs)``.

    Lightning's ``example_input_array`` when the module has one; else the batch as one argument (a forward that takes
    the batch); else the batch's first element (a forward that takes the inputs of an ``(inputs, targets)`` batch).

    Example:
        >>> [what for what, _, _ in example_inputs(nn.Linear(2, 2), (torch.ones(1, 2), torch.zeros(1)))]
        ['the batch', "the batch's first element"]
    """
    calls: list[tuple[str, tuple, dict]] = []
    example = getattr(model, "example_input_array", None)
    if isinstance(example, dict):
        calls.append(("example_input_array", (), example))
    elif isinstance(example, (tuple, list)):
        calls.append(("example_input_array", tuple(example), {}))
    elif example is not None:
        calls.append(("example_input_array", (example,), {}))
    if batch is not None:
        calls.append(("the batch", (batch,), {}))
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
            calls.append(("the batch's first element", (batch[0],), {}))
    return calls


def export_graph(model: nn.Module, batch: Any) -> tuple[Any, str]:
    """``(GraphDef, what it was drawn from)``, or ``(None, why none could be drawn)``; never raises.

    Args:
        model: the module whose ``forward`` to draw.
        batch: a training batch (the calls tried are :func:`example_inputs`).
    """
    reasons = []
    for what, args, kwargs in example_inputs(model, batch):
        try:
            # compiled regions (TorchCompile) are drawn as the ops they compile, not as dynamo's frames
            with warnings.catch_warnings(), torch.no_grad(), torch.compiler.set_stance("force_eager"):
                warnings.simplefilter("ignore")
                program = torch.export.export(model, args, kwargs, strict=False)
            return graph_def(program), what
        except Exception as err:  # export refuses much Python (data-dependent control flow, compiled code)
            reasons.append(f"{what}: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")
    if not reasons:
        reasons.append("no example input (set the LightningModule's example_input_array)")
    return None, "; ".join(reasons)


def draw_graph(writer: Any, model: nn.Module, batch: Any) -> str:
    """Write ``model``'s graph to ``writer``'s TensorBoard files; what it was drawn from, or why it was not.

    Args:
        writer: the callback's :class:`~lightning_opkit.core.logging.LogWriter`, or ``None``.
        model: the LightningModule.
        batch: the fit's first training batch.
    """
    if writer is None or not writer.tensorboard_dirs:
        return "not drawn (no TensorBoard logger)"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        # FSDP2's and tensor parallel's hooks would run their collectives in the export, on this rank alone
        return "not drawn (sharded parameters: FSDP2 or tensor parallel; draw it from an unsharded run)"
    graph, note = export_graph(model, batch)
    if graph is None:
        return f"not drawn ({note})"
    writer.graph(graph)
    return f"drawn from {note} (Graphs tab)"


def graph_def(program: Any) -> Any:
    """TensorBoard's ``GraphDef`` of an ``ExportedProgram``: one node per op, parameter and input.

    Args:
        program: what ``torch.export.export`` returned.
    """
    from tensorboard.compat.proto.attr_value_pb2 import AttrValue
    from tensorboard.compat.proto.graph_pb2 import GraphDef
    from tensorboard.compat.proto.node_def_pb2 import NodeDef
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.compat.proto.versions_pb2 import VersionDef

    signature = program.graph_signature
    owned = {**getattr(signature, "inputs_to_parameters", {}), **getattr(signature, "inputs_to_buffers", {})}
    names: dict[str, str] = {}
    taken: dict[str, int] = {}
    nodes = []
    for node in program.graph.nodes:
        if node.op == "placeholder":
            path = owned.get(node.name)
            name, op = (path.replace(".", "/"), "Parameter") if path else (f"input/{node.name}", "Input")
        elif node.op == "output":
            name, op = "output", "Output"
        else:
            stack = node.meta.get("nn_module_stack") or {}
            scope = next(reversed(stack.values()))[0].replace(".", "/") + "/" if stack else ""
            # named within its module, as a reader counts: qkv/linear, attn/matmul, attn/matmul_1 (export's own
            # names count across the whole model: linear_12)
            base = op_class = _aten_name(node.target)
            seen = taken.setdefault(scope + base, 0)
            taken[scope + base] = seen + 1
            name, op = f"{scope}{base}" + (f"_{seen}" if seen else ""), str(node.target)
        names[node.name] = name
        attr = {}
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            attr["_output_shapes"] = AttrValue(list=AttrValue.ListValue(shape=[TensorShapeProto(
                dim=[TensorShapeProto.Dim(size=int(d)) for d in value.shape])]))
            attr["dtype"] = AttrValue(s=full_name(value.dtype).encode())
        if node.op == "call_function":
            attr["op_class"] = AttrValue(s=classify_profiler_event(f"aten::{op_class}").encode())
        nodes.append(NodeDef(name=name, op=op, input=[names[i.name] for i in node.all_input_nodes if i.name in names],
                             attr=attr))
    return GraphDef(node=nodes, versions=VersionDef(producer=22))


def _aten_name(target: Any) -> str:
    name = getattr(target, "__name__", str(target))  # "linear.default"
    return name.split(".")[0]
