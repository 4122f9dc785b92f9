"""What one stored base costs, computed from a UNet's config (no weights needed).

A base file holds the latent at every kept step, the unconditional prediction at every kept
step but the last, the base prompt's K/V of every cross-attention layer and the family's
per-prompt extras (SDXL: the pooled text embedding); the negative prompt's K/V are a file of
their own, shared by every base with that negative prompt. ``tests/test_families.py`` checks the
formula against the tensors of a real stored SDXL base; ``python -m edit_rt.export.compile.base_bytes``
prints docs/families.md's table for SD 1.5, SD 2.1 and SDXL at their native sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .graphs import cross_attention_layers

TEXT_LEN = 77
_ITEM = {"fp32": 4, "fp16": 2, "int8": 1}

# The UNet configs of the public checkpoints (the fields that decide the cross-attention layers)
SD15 = dict(block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, attention_head_dim=8, cross_attention_dim=768,
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)  # fmt: skip
SD21 = dict(SD15, attention_head_dim=(5, 10, 20, 20), cross_attention_dim=1024, use_linear_projection=True,
            upcast_attention=True)  # fmt: skip
SDXL = dict(block_out_channels=(320, 640, 1280), layers_per_block=2, attention_head_dim=(5, 10, 20),
            cross_attention_dim=2048, transformer_layers_per_block=(1, 2, 10), use_linear_projection=True,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816)  # fmt: skip
MODELS = {  # name: (UNet config, native size, pooled embedding width)
    "SD 1.5": (SD15, 512, 0),
    "SD 2.1": (SD21, 768, 0),
    "SDXL": (SDXL, 1024, 1280),
}


@dataclass(frozen=True)
class BaseBytes:
    latents: int  # x_i and u_i of the kept steps
    kv: int  # the base prompt's K/V (and extras)
    uncond_kv: int  # the negative prompt's, once per negative prompt

    @property
    def per_base(self) -> int:
        return self.latents + self.kv


def kv_widths(unet_config: dict) -> list[int]:
    """The inner width of every cross-attention layer (K and V are [77, width] each)."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):  # shapes only: SDXL's 2.6 B parameters are never allocated
        unet = UNet2DConditionModel(**unet_config)
    return [layer.inner_dim for layer, _ in cross_attention_layers(unet)]


def base_bytes(widths: list[int], latent_shape: tuple[int, int, int], steps: int, window_start: int = 0,
               latents_precision: str = "fp32", kv_precision: str = "fp32", pooled: int = 0) -> BaseBytes:  # fmt: skip
    """Bytes of one base's tensors as the store writes them (``runtime/store_codec.encode``:
    int8 adds an fp32 scale per step and channel of a latent, per channel of a K/V tensor)."""
    c, h, w = latent_shape
    kept = steps - window_start + 1
    per_latent = c * h * w * _ITEM[latents_precision] + (4 * c if latents_precision == "int8" else 0)
    latents = (2 * kept - 1) * per_latent  # x_ws..x_T, and u_ws..u_{T-1}
    kv = sum(2 * (TEXT_LEN * width * _ITEM[kv_precision] + (4 * width if kv_precision == "int8" else 0)) for width in widths)
    extras = 4 * pooled  # kept fp32
    return BaseBytes(latents, kv + extras, kv + extras)


def table(steps: int = 50) -> list[tuple[str, str, BaseBytes, BaseBytes]]:
    """(model, size, fp32 bytes, fp16 bytes) for the public checkpoints at their native size."""
    rows = []
    for name, (config, size, pooled) in MODELS.items():
        widths = kv_widths(config)
        shape = (4, size // 8, size // 8)
        rows.append((name, f"{size}x{size}", base_bytes(widths, shape, steps, pooled=pooled),
                     base_bytes(widths, shape, steps, latents_precision="fp16", kv_precision="fp16", pooled=pooled)))  # fmt: skip
    return rows


if __name__ == "__main__":
    print("| model | size | layers | fp32 per base | fp16 per base | negative prompt (once) fp32 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, size, full, half in table():
        layers = len(kv_widths(MODELS[name][0]))
        print(f"| {name} | {size} | {layers} | {full.per_base / 2**20:.1f} MiB | {half.per_base / 2**20:.1f} MiB "
              f"| {full.uncond_kv / 2**20:.1f} MiB |")  # fmt: skip
