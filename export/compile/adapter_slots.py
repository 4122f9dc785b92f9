"""LoRA adapters as resident, per-row-scaled branches of the compiled graphs.

A LoRA adapter changes a linear layer ``y = W x`` into ``y = W x + s B A x`` (A: ``[r, in]``,
B: ``[out, r]``, s the adapter's scale, alpha/r folded into B). Fused into W, every row of a
call would carry the same adapters at the same scale, and a new LoRA would need a new engine
(TensorRT's refit: TensorRT #2936, #3628). Unfused, the branch is two small matmuls, so edit-rt
keeps ``slots`` adapters *resident* as graph inputs, like K/V: each adapted layer takes

- ``<graph>_lora_down_<j> [slots * rank, in]``: the slots' A matrices stacked (zeros where an
  adapter has a lower rank or does not touch the layer),
- ``<graph>_lora_up_<j> [out, slots * rank]``: their B matrices side by side,

and the graph one ``adapter_scale [rows, slots]`` (each row's scale per slot), so a layer adds
``((x A_all^T) * repeat(scale, rank)) B_all^T``: every row its own set of ``{adapter: scale}``.
Loading a LoRA writes its matrices into a slot; no graph is exported or built again.

Which layers (the ones diffusers' and kohya's LoRA trainers adapt, and the text encoders'):

- ``unet_step``: in every transformer block ``attn1.to_q/to_k/to_v/to_out.0``,
  ``attn2.to_q/to_out.0``, ``ff.net.0.proj``, ``ff.net.2``, and the blocks' ``proj_in`` /
  ``proj_out`` (a Linear, or SD 1.x's 1x1 convolution);
- ``kv_proj``: ``attn2.to_k/to_v`` (the UNet's LoRA on them changes the cached K/V: it is
  folded into each row's K/V, as the text encoders' is);
- ``text_encoder``: each CLIP layer's ``q/k/v/out_proj`` and ``mlp.fc1/fc2``, of both encoders
  on SDXL.

Layer names are diffusers' LoRA module paths (``unet.<module>``, ``text_encoder.<module>``,
``text_encoder_2.<module>``): the converter (export/compile/adapters.py) maps a loaded LoRA onto them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

# The UNet's adaptable layers in the step graph; attn2's to_k/to_v are kv_proj's.
_STEP = re.compile(r"(transformer_blocks\.\d+\.(attn1\.(to_q|to_k|to_v|to_out\.0)|attn2\.(to_q|to_out\.0)|ff\.net\.(0\.proj|2))"
                   r"|attentions\.\d+\.(proj_in|proj_out))$")  # fmt: skip
_KV = re.compile(r"transformer_blocks\.\d+\.attn2\.(to_k|to_v)$")
_TEXT = re.compile(r"encoder\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))$")
PATTERNS = {"unet_step": _STEP, "kv_proj": _KV, "text_encoder": _TEXT}


@dataclass(frozen=True)
class AdapterLayer:
    """One adapted layer: its LoRA module path, the graph and inputs that carry it, its shape."""

    name: str  # "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    graph: str  # unet_step | kv_proj | text_encoder
    down: str  # the graph's input names
    up: str
    in_features: int
    out_features: int

    def manifest(self) -> dict:
        return {"name": self.name, "graph": self.graph, "down": self.down, "up": self.up,
                "in": self.in_features, "out": self.out_features}  # fmt: skip


class SlotContext:
    """The tensors one graph call hands its :class:`SlotLoRA` layers: the weights per layer and
    the per-row scales repeated rank times, ``[rows, slots * rank]``."""

    def __init__(self, rank: int):
        self.rank = rank
        self.weights: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.scale: Optional[torch.Tensor] = None


class SlotLoRA(nn.Module):
    """``base(x) + ((x A^T) * scale) B^T`` with A, B the slots' stacked matrices (graph inputs).
    A 1x1 convolution is the same over the channel axis."""

    def __init__(self, base: nn.Module, context: SlotContext, index: int):
        super().__init__()
        self.base = base
        self.context = context
        self.index = index
        self.conv = isinstance(base, nn.Conv2d)
        # what code around the layer reads of it (diffusers' attention reads to_k.out_features)
        self.in_features = base.in_channels if self.conv else base.in_features
        self.out_features = base.out_channels if self.conv else base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down, up = self.context.weights[self.index]
        scale = self.context.scale
        if self.conv:
            z = F.conv2d(x, down[:, :, None, None]) * scale[:, :, None, None]
            return self.base(x) + F.conv2d(z, up[:, :, None, None])
        z = torch.matmul(x, down.t())
        z = z * scale.view(scale.shape[0], *([1] * (x.dim() - 2)), scale.shape[1])
        return self.base(x) + torch.matmul(z, up.t())


def _adaptable(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1) and module.groups == 1


def install(root: nn.Module, prefix: str, graph: str, context: SlotContext, layers: list[AdapterLayer]) -> None:
    """Wrap every adaptable layer of ``root`` that ``graph`` carries in a :class:`SlotLoRA`
    reading ``context``; append what it wrapped to ``layers`` (the graph's input order)."""
    pattern = PATTERNS[graph]
    for path, module in list(root.named_modules()):
        if isinstance(module, SlotLoRA) or not pattern.search(path) or not _adaptable(module):
            continue
        parent_path, _, attr = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        j = sum(1 for layer in layers if layer.graph == graph)
        setattr(parent, attr, SlotLoRA(module, context, len(context.weights)))
        context.weights.append((torch.empty(0), torch.empty(0)))
        wrapped = parent.get_submodule(attr)
        layers.append(AdapterLayer(f"{prefix}.{path}", graph, f"{graph}_lora_down_{j}", f"{graph}_lora_up_{j}",
                                   wrapped.in_features, wrapped.out_features))  # fmt: skip


class WithAdapters(nn.Module):
    """``graph`` with its adapter inputs appended: ``(*graph inputs, adapter_scale, down_0,
    up_0, ...)``. ``row_scale`` maps the call's inputs and ``adapter_scale`` [rows, slots] to
    the scale of the rows the wrapped layers see (the step graph's UNet runs [uncond; cond])."""

    def __init__(self, graph: nn.Module, inputs: int, context: SlotContext,
                 row_scale: Optional[Callable[[tuple, torch.Tensor], torch.Tensor]] = None):  # fmt: skip
        super().__init__()
        self.graph = graph
        self.inputs = inputs
        self.context = context
        self.row_scale = row_scale

    def forward(self, *args):
        fixed, scale, weights = args[: self.inputs], args[self.inputs], args[self.inputs + 1 :]
        if self.row_scale is not None:
            scale = self.row_scale(fixed, scale)
        rows, slots = scale.shape
        self.context.scale = scale[:, :, None].expand(rows, slots, self.context.rank).reshape(rows, slots * self.context.rank)
        self.context.weights = [(weights[2 * i], weights[2 * i + 1]) for i in range(len(weights) // 2)]
        return self.graph(*fixed)


def step_row_scale(fixed: tuple, scale: torch.Tensor) -> torch.Tensor:
    """The step graph's UNet rows are ``[uncond rows 0..nu-1; cond rows 0..N-1]`` with nu = N - E
    (E rows given their unconditional prediction): both halves of a row take its scale."""
    nu = fixed[0].shape[0] - fixed[6].shape[0]  # latents [N, ...], uncond_given [E, ...]
    return torch.cat([scale[:nu], scale])


def install_all(components, rank: int) -> tuple[list[AdapterLayer], dict[str, SlotContext]]:
    """Slot branches on every adaptable layer of a family's components (text encoders, UNet),
    in the graphs' input order; the layers and each graph's context."""
    layers: list[AdapterLayer] = []
    contexts = {graph: SlotContext(rank) for graph in PATTERNS}
    for encoder, prefix in zip(components.text_encoders, ("text_encoder", "text_encoder_2")):
        install(encoder, prefix, "text_encoder", contexts["text_encoder"], layers)
    install(components.unet, "unet", "kv_proj", contexts["kv_proj"], layers)
    install(components.unet, "unet", "unet_step", contexts["unet_step"], layers)
    return layers, contexts


def wrap(graph: str, module: nn.Module, inputs: int, contexts: dict[str, SlotContext]) -> nn.Module:
    """``module`` (the torch source of ``graph``, ``inputs`` inputs of its own) taking the
    adapter inputs after its own."""
    context = contexts["unet_step" if graph.startswith("unet_step") else graph]
    return WithAdapters(module, inputs, context, step_row_scale if graph.startswith("unet_step") else None)


def example_inputs(layers: list[AdapterLayer], graph: str, rows: int, slots: int, rank: int) -> list[tuple[str, torch.Tensor, dict]]:
    """(name, example, dynamic axes) of ``graph``'s adapter inputs, for tracing: the scale
    ``[rows, slots]`` (rows dynamic) and each layer's stacked A and B. The step graph's slot axis
    is dynamic too (``P`` slots, ``R`` = P x rank columns): a call whose rows use no adapter
    binds none (zero-width matrices: the branch costs nothing), one that does binds them all;
    the text graphs' are static (they run once per prompt, not per step)."""
    step = graph == "unet_step"
    batch = "N" if step else "B"
    out = [("adapter_scale", torch.randn(rows, slots), {0: batch, 1: "P"} if step else {0: batch})]
    for layer in (l for l in layers if l.graph == graph):
        out.append((layer.down, torch.randn(slots * rank, layer.in_features) * 0.1, {0: "R"} if step else {}))
        out.append((layer.up, torch.randn(layer.out_features, slots * rank) * 0.1, {1: "R"} if step else {}))
    return out
