"""LoRA adapters with a scale per row, against diffusers' own LoRA loading.

The references: ``pipe.load_lora_weights(file)`` + ``pipe.set_adapters([name],
adapter_weights=[s])`` on the same tiny models (SD 1.x and SDXL), for a generation and for an
edit tail (diffusers' UNet and DDIM scheduler run from the base's cached latent at the entry
step, the adapters on from there), in peft format and in kohya / AUTOMATIC1111 format (written
here from the same matrices under kohya's key names, which diffusers converts itself).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

from edit_rt.export.compile.adapters import convert_adapter, convert_adapters
from edit_rt.export.compile.onnx_export import export_onnx
from edit_rt.runtime.engine.manifest import load_manifest
from edit_rt.runtime.errors import ConfigError, ModelError
from edit_rt.runtime.model.edit import Base, TailRow
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

from .conftest import TEST_BASE

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
ATOL = 1e-4  # as test_pipeline's generation check: fp32 noise through the chain and the VAE


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Both LoRA matrices non-zero (peft starts B at zero), small as trained ones are."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.15


def make_lora(model_dir: Path, out: Path, seed: int, sdxl: bool = False, rank: int = 4, alpha: float = 8.0,
              text: bool = True) -> Path:  # fmt: skip
    """A peft-format LoRA of ``model_dir``'s UNet (and text encoders), saved by diffusers."""
    cls = StableDiffusionXLPipeline if sdxl else StableDiffusionPipeline
    pipe = cls.from_pretrained(model_dir)
    pipe.unet.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=UNET_TARGETS))
    _randomize(pipe.unet, seed)
    layers = {"unet_lora_layers": get_peft_model_state_dict(pipe.unet)}
    meta = {"unet_lora_adapter_metadata": pipe.unet.peft_config["default"].to_dict()}
    encoders = [("text_encoder", pipe.text_encoder)] + ([("text_encoder_2", pipe.text_encoder_2)] if sdxl else [])
    for k, (name, encoder) in enumerate(encoders if text else []):
        encoder.add_adapter(LoraConfig(r=rank, lora_alpha=alpha / 2, target_modules=TEXT_TARGETS))
        _randomize(encoder, seed + 1 + k)
        layers[f"{name}_lora_layers"] = get_peft_model_state_dict(encoder)
        meta[f"{name}_lora_adapter_metadata"] = encoder.peft_config["default"].to_dict()
    cls.save_lora_weights(out, **layers, **meta)
    return out / "pytorch_lora_weights.safetensors"


def kohya_copy(peft_file: Path, out: Path, alpha: float = 8.0) -> Path:
    """The same LoRA under kohya / AUTOMATIC1111 key names (``lora_unet_*``, ``lora_te_*``,
    ``.lora_down/.lora_up/.alpha``), for diffusers' kohya conversion."""
    from safetensors.torch import load_file

    state = load_file(str(peft_file))
    kohya = {}
    for key, value in state.items():
        component, rest = key.split(".", 1)
        module, kind = rest.rsplit(".lora_", 1)
        kind = "lora_down.weight" if kind.startswith("A") else "lora_up.weight"
        prefix = {"unet": "lora_unet_", "text_encoder": "lora_te_text_model_", "text_encoder_2": "lora_te2_text_model_"}[component]
        name = prefix + module.replace("text_model.", "").replace(".", "_")
        kohya[f"{name}.{kind}"] = value
        kohya[f"{name}.alpha"] = torch.tensor(alpha if component == "unet" else alpha / 2)
    save_file(kohya, str(out))
    return out


@pytest.fixture(scope="module")
def adapter_onnx(adapter_onnx_dir) -> Path:
    return adapter_onnx_dir


@pytest.fixture(scope="module")
def lora_files(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    peft = make_lora(model_dir, root / "peft", seed=5)
    other = make_lora(model_dir, root / "unet-only", seed=9, text=False)
    return {"peft": peft, "kohya": kohya_copy(peft, root / "kohya.safetensors"), "unet": other}


@pytest.fixture(scope="module")
def converted(model_dir, adapter_onnx, lora_files) -> dict[str, Path]:
    return convert_adapters(model_dir, load_manifest(adapter_onnx), lora_files, adapter_onnx.parent / "adapters")


@pytest.fixture(scope="module")
def lora_pipe(adapter_onnx, model_dir, converted):
    with EditPipeline(adapter_onnx, model_dir, adapters=converted) as pipe:
        yield pipe


def _diffusers(model_dir: Path, loras: dict[str, Path], cls=StableDiffusionPipeline):
    """diffusers' pipeline with DDIM and ``loras`` loaded by name (``set_adapters`` picks)."""
    pipe = cls.from_pretrained(model_dir)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    for name, lora in loras.items():
        pipe.load_lora_weights(str(lora), adapter_name=name)
    return pipe


@pytest.fixture(scope="module")
def reference(model_dir, lora_files):
    return _diffusers(model_dir, {k: lora_files[k] for k in ("peft", "kohya")})


def _diffusers_generation(pipe, base: Base, noise: np.ndarray) -> np.ndarray:
    return pipe(base.prompt, negative_prompt=base.negative_prompt, num_inference_steps=base.steps,
                guidance_scale=base.guidance, height=base.height, width=base.width, eta=0.0,
                latents=torch.from_numpy(noise), output_type="np").images  # fmt: skip


@torch.no_grad()
def _diffusers_tail(pipe, base: Base, prompt: str, latent: np.ndarray, start: int) -> np.ndarray:
    """diffusers' UNet + DDIM from ``latent`` (x at step ``start``) to the end, with classifier-free
    guidance as StableDiffusionPipeline runs it, decoded as it decodes."""
    cond, uncond = pipe.encode_prompt(prompt, "cpu", 1, True, base.negative_prompt)
    embeds = torch.cat([uncond, cond])
    pipe.scheduler.set_timesteps(base.steps)
    x = torch.from_numpy(latent)
    for t in pipe.scheduler.timesteps[start:]:
        out = pipe.unet(torch.cat([x, x]), t, encoder_hidden_states=embeds).sample
        u, c = out.chunk(2)
        x = pipe.scheduler.step(u + base.guidance * (c - u), t, x, eta=0.0).prev_sample
    image = pipe.vae.decode(x / pipe.vae.config.scaling_factor).sample
    return (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize("fmt", ["peft", "kohya"])
def test_generation_with_an_adapter_equals_diffusers_set_adapters(lora_pipe, reference, fmt):
    base = dataclasses.replace(TEST_BASE, adapters={fmt: 0.7})
    noise = lora_pipe.initial_noise(base)
    ours = lora_pipe.decode(lora_pipe.generate_base(base, noise=noise).final_latent)
    reference.set_adapters([fmt], adapter_weights=[0.7])
    expected = _diffusers_generation(reference, base, noise)
    np.testing.assert_allclose(ours, expected, atol=ATOL)
    plain = lora_pipe.decode(lora_pipe.generate_base(TEST_BASE, noise=noise).final_latent)
    assert np.abs(plain - expected).max() > 1e-2  # the adapter matters at this scale


def test_tail_with_an_adapter_equals_diffusers_from_the_cached_latent(lora_pipe, reference):
    """The base without adapters, its edit from step 4 with the LoRA at -1.3 (UNet, text
    encoder: the edit's prompt and negative prompt re-encoded under it, its own entry u)."""
    state = lora_pipe.generate_base(TEST_BASE)
    prompt = "a green circle on a blue background"
    row = TailRow(prompt, 1.0, 4, TEST_BASE.guidance, adapters={"kohya": (-1.3, -1.3)})
    ours = lora_pipe.decode(lora_pipe.run_tail(state, [row]))
    reference.set_adapters(["kohya"], adapter_weights=[-1.3])
    expected = _diffusers_tail(reference, TEST_BASE, prompt, state.latent(4), 4)
    np.testing.assert_allclose(ours, expected, atol=ATOL)


def test_a_deepcache_tail_with_an_adapter_equals_diffusers_blocks(lora_pipe, reference):
    """``deepcache: 2`` with a LoRA: the shallow steps' outer blocks carry the adapter too
    (test_deepcache.py's reference: diffusers' blocks called directly, the LoRA loaded in them)."""
    from .test_deepcache import _unet

    state = lora_pipe.generate_base(TEST_BASE)
    prompt = "a green circle on a blue background"
    row = TailRow(prompt, 1.0, 4, TEST_BASE.guidance, adapters={"kohya": (-1.3, -1.3)}, deepcache=2)
    ours = lora_pipe.decode(lora_pipe.run_tail(state, [row]))
    reference.set_adapters(["kohya"], adapter_weights=[-1.3])
    with torch.no_grad():
        cond, uncond = reference.encode_prompt(prompt, "cpu", 1, True, TEST_BASE.negative_prompt)
        reference.scheduler.set_timesteps(TEST_BASE.steps)
        x, feature = torch.from_numpy(state.latent(4)), None
        for j, t in enumerate(reference.scheduler.timesteps[4:]):
            out, feature = _unet(reference.unet, torch.cat([x, x]), t, torch.cat([uncond, cond]), None if j % 2 == 0 else feature)
            u, c = out.chunk(2)
            x = reference.scheduler.step(u + TEST_BASE.guidance * (c - u), t, x, eta=0.0).prev_sample
        image = reference.vae.decode(x / reference.vae.config.scaling_factor).sample
    expected = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(ours, expected, atol=ATOL)


def test_the_shallow_step_with_slots_matches_its_torch_source(adapter_onnx, model_dir):
    """unet_step_shallow of an export with slots against its PyTorch source (the skipped
    layers' LoRA inputs are dropped by the exporter: parity fills them in at their width)."""
    from .test_graphs import assert_graph_matches_torch

    assert_graph_matches_torch("unet_step_shallow", adapter_onnx, model_dir)


def test_adapter_at_scale_zero_is_no_adapter_exactly(lora_pipe):
    """A call no row of which uses an adapter binds the slots zero wide (the slot-free binding:
    no LoRA branch runs); a row with an adapter at scale 0 binds them all: the same latents."""
    state = lora_pipe.generate_base(TEST_BASE)
    scheduler = lora_pipe.batcher(state.latents.shape[1:]).scheduler
    scheduler.bindings.free()
    none = lora_pipe.run_tail(state, [TailRow("a blue square", 1.0, 5, 7.5)])
    assert {key[-1] for key in scheduler.bindings._items} == {False}  # slot-free
    zero = lora_pipe.run_tail(state, [TailRow("a blue square", 1.0, 5, 7.5, adapters={"peft": (0.0, 0.0)})])
    assert {key[-1] for key in scheduler.bindings._items} == {False, True}
    np.testing.assert_array_equal(zero, none)


def test_rows_with_different_adapters_batched_equal_each_alone(lora_pipe):
    state = lora_pipe.generate_base(dataclasses.replace(TEST_BASE, adapters={"unet": 0.5}))
    rows = [
        TailRow("a blue square", 1.0, 4, 7.5, adapters={"peft": (1.0, 1.0)}),
        TailRow("a blue square", 1.0, 4, 7.5, adapters={"peft": (-0.5, -0.5), "unet": (0.5, 0.5)}),
        TailRow("a green circle", 0.5, 6, 5.0, adapters={"unet": (2.0, 2.0), "kohya": (0.3, 0.3)}),
        TailRow("a green circle", 1.0, 3, 7.5),  # the base's adapters
        TailRow("a green circle", 1.0, 3, 7.5, adapters={}),  # none at all
    ]
    batched = lora_pipe.run_tail(state, rows)
    for k, row in enumerate(rows):
        alone = lora_pipe.run_tail(state, [row])[0]
        np.testing.assert_allclose(batched[k], alone, rtol=1e-5, atol=2e-5)  # as test_isolation: fp32 order
    assert np.abs(batched[3] - batched[4]).max() > 1e-3  # the base's adapter stays on unless taken off


@pytest.mark.slow  # ~10-20 s; the default run keeps SD 1.x against set_adapters
def test_sdxl_generation_and_tail_with_an_adapter_equal_diffusers(sdxl_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sdxl-lora")
    onnx = root / "build" / "onnx"
    export_onnx(sdxl_dir, onnx, adapter_slots_n=2, adapter_rank=4)
    lora = make_lora(sdxl_dir, root / "lora", seed=3, sdxl=True)
    files = convert_adapters(sdxl_dir, load_manifest(onnx), {"x": lora}, root / "adapters")
    # DDIM asked for (SDXL's config would run Euler): the reference below runs DDIM
    base = Base(prompt="a red circle", negative_prompt="blurry", seed=2, steps=8, guidance=6.0, width=32, height=32,
                adapters={"x": 0.8}, sampler="ddim")  # fmt: skip
    with EditPipeline(onnx, sdxl_dir, adapters=files) as pipe:
        noise = pipe.initial_noise(base)
        ours = pipe.decode(pipe.generate_base(base, noise=noise).final_latent)
    reference = _diffusers(sdxl_dir, {"x": lora}, StableDiffusionXLPipeline)
    reference.set_adapters(["x"], adapter_weights=[0.8])
    expected = reference(base.prompt, negative_prompt=base.negative_prompt, num_inference_steps=base.steps,
                         guidance_scale=base.guidance, height=32, width=32, eta=0.0,
                         latents=torch.from_numpy(noise), output_type="np").images  # fmt: skip
    np.testing.assert_allclose(ours, expected, atol=ATOL)


# --- bad input ---------------------------------------------------------------------------------


def test_unknown_adapter_fails_its_row_alone(lora_pipe):
    state = lora_pipe.generate_base(TEST_BASE)
    good = TailRow("a blue square", 1.0, 5, 7.5, adapters={"peft": (0.5, 0.5)})
    bad = TailRow("a blue square", 1.0, 5, 7.5, adapters={"nope": (0.5, 0.5)})
    results = lora_pipe.edit(state, [good, bad], decode=False, errors=True)
    assert isinstance(results[1], ConfigError) and "edit.adapters.nope" in str(results[1]) and "peft" in str(results[1])
    np.testing.assert_allclose(results[0].latent, lora_pipe.run_tail(state, [good])[0], atol=1e-5)


def test_scale_out_of_range_and_too_many_adapters_are_refused_by_field(lora_pipe):
    from pydantic import ValidationError

    from edit_rt.runtime.model.edit import Edit

    with pytest.raises(ValidationError, match="adapters"):
        Edit(prompt="a blue square", adapters={"peft": 9.0})
    state = lora_pipe.generate_base(TEST_BASE)
    many = {name: (0.5, 0.5) for name in ("peft", "kohya", "unet")}
    lora_pipe.load_adapter("peft2", lora_pipe.adapter_bank.adapters["peft"].path)
    many["peft2"] = (0.5, 0.5)
    (result,) = lora_pipe.edit(state, [TailRow("a blue square", 1.0, 5, 7.5, adapters=many)], decode=False, errors=True)
    assert isinstance(result, ConfigError) and "4 adapters in one row" in str(result) and "adapter_slots" in str(result)


def test_lora_of_another_architecture_names_the_file_and_layer(adapter_onnx, model_dir, sdxl_dir, tmp_path):
    lora = make_lora(sdxl_dir, tmp_path / "xl-lora", seed=1, sdxl=True, text=False)
    with pytest.raises(ModelError) as err:
        convert_adapter(model_dir, load_manifest(adapter_onnx), lora, "xl", tmp_path / "xl.safetensors")
    text = str(err.value)
    assert str(lora) in text and ("layer" in text or "placed only" in text)


@pytest.mark.parametrize("keys,what", [
    ({"lora_unet_mid_block_attentions_0_proj_in.hada_w1_a": (4, 8)}, "LoHa"),
    ({"lora_unet_mid_block_attentions_0_proj_in.lokr_w1": (4, 4)}, "LoKr"),
    ({"lora_unet_mid_block_attentions_0_proj_in.dora_scale": (1, 8)}, "DoRA"),
])  # fmt: skip
def test_adapter_types_edit_rt_cannot_apply_are_refused_by_name(adapter_onnx, model_dir, tmp_path, keys, what):
    path = tmp_path / "odd.safetensors"
    save_file({k: torch.zeros(shape) for k, shape in keys.items()}, str(path))
    with pytest.raises(ModelError, match=what):
        convert_adapter(model_dir, load_manifest(adapter_onnx), path, "odd", tmp_path / "odd-out.safetensors")


def test_export_without_slots_refuses_adapters_with_the_fix(onnx_dir, model_dir, converted):
    with pytest.raises(ConfigError, match="export.adapter_slots"):
        EditPipeline(onnx_dir, model_dir, adapters=converted)


def test_a_sweep_is_its_rows_one_by_one(lora_pipe):
    """``sweep`` expands into n edits at evenly spaced scales (model/sweep.py); as one batched
    tail they equal each row run alone."""
    from edit_rt.runtime.model.edit import Edit, EditDefaults, resolve_edit
    from edit_rt.runtime.model.sweep import expand_all

    state = lora_pipe.generate_base(TEST_BASE)
    edit = Edit(prompt="a blue square", tail_steps=5, sweep={"adapter": "peft", "from": -1.0, "to": 1.0, "n": 3})
    edits = expand_all([edit])
    assert [e.label for e in edits] == ["peft=-1: a blue square", "peft=0: a blue square", "peft=1: a blue square"]
    rows = [resolve_edit(e, state.base, 0, EditDefaults()) for e in edits]
    assert [r.adapters for r in rows] == [{"peft": (-1.0, -1.0)}, {}, {"peft": (1.0, 1.0)}]
    batched = lora_pipe.run_tail(state, rows)
    for k, row in enumerate(rows):
        np.testing.assert_allclose(batched[k], lora_pipe.run_tail(state, [row])[0], rtol=1e-5, atol=2e-5)
    plain = lora_pipe.run_tail(state, [TailRow("a blue square", 1.0, 5, TEST_BASE.guidance)])[0]
    np.testing.assert_allclose(batched[1], plain, rtol=1e-5, atol=2e-5)  # scale 0: the row without the adapter


def test_a_sweep_that_names_no_direction_is_refused_by_field(model_dir, tmp_path):
    from edit_rt.runtime.config.load import config_from_dict

    cfg = {"model": str(model_dir), "base": {"prompt": "a red circle", "steps": 10, "width": 32, "height": 32},
           "edits": [{"prompt": "a blue square"},
                     {"directions": [{"prompt": "a big red circle", "strength": 0.5}], "sweep": {"direction": 1, "from": 0.0, "to": 1.0}}]}  # fmt: skip
    with pytest.raises(ConfigError, match=r"edits\[1\]\.sweep\.direction: 1 names no direction"):
        config_from_dict(cfg)
    cfg["edits"][1]["sweep"]["direction"] = 0
    expanded = config_from_dict(cfg).edits
    assert len(expanded) == 1 + 9 and [e.directions[0].strength for e in expanded[1:]] == [0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0]
