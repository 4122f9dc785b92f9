"""fp16 ONNX graphs with fp32 islands, the input of strongly typed TensorRT builds.

A strongly typed TensorRT network (``NetworkDefinitionCreationFlag.STRONGLY_TYPED``) runs every
tensor in the type the ONNX graph gives it: no builder flag may lower a layer, so the precision
is decided here, once, and is the same on every GPU. TensorRT 10.12 deprecates the weakly typed
precision controls (``BuilderFlag.FP16``, ``precision_constraints``, ``layer.precision``,
``set_output_type``) and TensorRT 11 removes them.

:func:`fp16_graph` casts a graph's weights and activations to fp16 with onnxconverter-common's
``convert_float_to_float16`` (the converter ONNX Runtime's own transformers tools use), keeping
in fp32 what the model needs there:

- in the step graphs, everything outside the UNet module: classifier-free guidance and the DDIM
  update (the latents are O(1) and their updates are O(1e-3) of them, below fp16's resolution
  at 1.0), and the latents, scalars and outputs themselves;
- under ``upcast_attention`` (SD 2.x), each attention's scores and softmax;
- nothing in a ``force_upcast`` VAE (SDXL 1.0's overflows in fp16) and in ``latent_blend``:
  they are not converted at all.

The cross-attention K/V inputs become fp16 graph inputs, so the runtime's resident K/V slots
are fp16 on the device (half the memory and bandwidth of fp32).
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
import onnx.helper
from onnx import TensorProto

log = logging.getLogger(__name__)


def unet_fp32_nodes(model: onnx.ModelProto) -> set[str]:
    """The step graph's nodes outside the UNet module (TorchScript names nodes by module scope,
    ``/unet/...`` inside it): guidance, the DDIM update, the row and set bookkeeping."""
    return {node.name for node in model.graph.node if not node.name.startswith("/unet/")}


def fp16_graph(source: Path, target: Path, fp32_nodes: set[str], fp16_inputs: set[str]) -> Path:
    """Write ``source`` as fp16 to ``target``: ``fp32_nodes`` stay fp32, the graph inputs named
    in ``fp16_inputs`` take fp16, every other input and output keeps its type."""
    from onnxconverter_common import float16

    model = onnx.load(str(source))
    # A Cast to float32 (the time embedding's, say) is left as it is by the converter while its
    # output is retyped fp16: keep such casts in fp32, with converter-made casts around them.
    fp32_nodes = set(fp32_nodes) | {n.name for n in model.graph.node if n.op_type == "Cast"
                                    and any(a.name == "to" and a.i == TensorProto.FLOAT for a in n.attribute)}  # fmt: skip
    _unshare_initializers(model.graph, fp32_nodes)
    fp32_nodes |= _separate_outputs(model.graph, fp32_nodes)
    large = model.ByteSize() > 1 << 30  # in-memory shape inference stops at protobuf's 2 GiB
    converted = float16.convert_float_to_float16(model, keep_io_types=True, node_block_list=sorted(fp32_nodes),
                                                 disable_shape_infer=large)  # fmt: skip
    _fp16_inputs(converted.graph, fp16_inputs)
    _float_outputs(converted.graph, {o.name for o in model.graph.output if o.type.tensor_type.elem_type == TensorProto.FLOAT})
    target.unlink(missing_ok=True)
    data = target.with_name(target.name + "_data")
    data.unlink(missing_ok=True)
    if large:
        onnx.save_model(converted, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024)  # fmt: skip
    else:
        onnx.save_model(converted, str(target))
    onnx.checker.check_model(str(target))
    log.info("%s -> %s (fp16, %d nodes kept fp32, %d fp16 inputs)", source.name, target.name, len(fp32_nodes), len(fp16_inputs))
    return target


def _unshare_initializers(graph: onnx.GraphProto, fp32_nodes: set[str]) -> None:
    """Give the fp32 nodes their own copy of a weight they share with fp16 nodes (the exporter
    dedupes equal constants): the converter leaves a weight that any fp32 node reads in fp32,
    and its fp16 readers would then mix types."""
    inits = {i.name: i for i in graph.initializer}
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            if name in inits:
                users.setdefault(name, []).append(node)
    for name, nodes in users.items():
        kept = [n for n in nodes if n.name in fp32_nodes]
        if kept and len(kept) < len(nodes):
            copy = onnx.TensorProto()
            copy.CopyFrom(inits[name])
            copy.name = f"{name}__fp32"
            graph.initializer.append(copy)
            for node in kept:
                node.input[:] = [copy.name if i == name else i for i in node.input]


def _separate_outputs(graph: onnx.GraphProto, fp32_nodes: set[str]) -> set[str]:
    """A graph output that other nodes read too (``uncond_out`` feeds the guidance) gets its own
    Identity: the converter would otherwise retype the shared tensor. Returns the new nodes
    that belong to an fp32 producer's island."""
    readers = {name for node in graph.node for name in node.input}
    added = set()
    for out in graph.output:
        if out.name not in readers:
            continue
        inner = f"{out.name}__inner"
        for node in graph.node:
            node.output[:] = [inner if o == out.name else o for o in node.output]
            node.input[:] = [inner if i == out.name else i for i in node.input]
            if inner in node.output and node.name in fp32_nodes:
                added.add(f"{out.name}__identity")
        graph.node.append(onnx.helper.make_node("Identity", [inner], [out.name], name=f"{out.name}__identity"))
    return added


def _float_outputs(graph: onnx.GraphProto, names: set[str]) -> None:
    """Every output that was fp32 stays fp32 (the converter casts an fp32 island's outputs to
    fp16 on their way out, even with ``keep_io_types``)."""
    producer = {o: n for n in graph.node for o in n.output}
    for out in graph.output:
        if out.name not in names or out.type.tensor_type.elem_type == TensorProto.FLOAT:
            continue
        node = producer[out.name]
        if node.op_type == "Cast":
            for attr in node.attribute:
                if attr.name == "to":
                    attr.i = TensorProto.FLOAT
        else:
            inner = f"{out.name}__fp16"
            node.output[:] = [inner if o == out.name else o for o in node.output]
            graph.node.append(onnx.helper.make_node("Cast", [inner], [out.name], to=TensorProto.FLOAT, name=f"{out.name}__to_fp32"))
        out.type.tensor_type.elem_type = TensorProto.FLOAT


def _fp16_inputs(graph: onnx.GraphProto, names: set[str]) -> None:
    """Make the named fp32 inputs fp16 and drop the Cast the converter put after each."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    for value in graph.input:
        if value.name not in names or value.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        casts = [n for n in consumers.get(value.name, []) if n.op_type == "Cast"
                 and any(a.name == "to" and a.i == TensorProto.FLOAT16 for a in n.attribute)]  # fmt: skip
        if len(casts) != len(consumers.get(value.name, [])) or not casts:
            continue  # some fp32 node reads it as is: it stays an fp32 input
        for cast in casts:
            for node in graph.node:
                node.input[:] = [value.name if i == cast.output[0] else i for i in node.input]
            graph.node.remove(cast)
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
