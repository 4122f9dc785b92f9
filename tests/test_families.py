"""Model families: SDXL and SD 2.x through the same export and runtime, and clean refusals.

A tiny random SDXL (two text encoders, ``text_time`` added conditioning, SDXL's Euler scheduler
config) is built in diffusers and checked against diffusers itself: every graph against its
PyTorch source (Polygraphy), a full generation against ``StableDiffusionXLPipeline`` + its Euler,
an edit at strength s against the pipeline fed the s-mixed prompt and pooled embeddings. Then
the runtime's own promises on it (identity, batching, masks), the store's bytes, the server.
SD 2.x's switches (v-prediction, upcast_attention, linear projections) and clip_skip go against
``StableDiffusionPipeline``; fp16 weights (as a variant, and under the default names) against
diffusers loading the same files; every refused family through the real CLI.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml
from diffusers import DDIMScheduler, StableDiffusionPipeline
from PIL import Image

from edit_rt.runtime.engine.manifest import load_manifest
from edit_rt.runtime.model.edit import Base, Mask
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline, TailRow
from edit_rt.runtime.pipeline.images import to_uint8

from .cli_in_process import Ran, edit_rt
from .conftest import TEST_BASE
from .server_process import ServerProcess
from .test_graphs import assert_graph_matches_torch

BATCH_ATOL = 1e-5  # as tests/test_pipeline.py: fp32 reordering across batch sizes
GRAPHS = ["text_encoder", "kv_proj", "unet_step", "latent_blend", "vae_decoder", "vae_encoder"]


# every SDXL promise on each CPU engine: ONNX Runtime and OpenVINO (fp32) read the same graphs;
# OpenVINO's run of them is in make test-all, the default run holds it by each graph against its
# torch source and one generation per family (tests/test_openvino.py)
@pytest.fixture(scope="module", params=["ort-cpu", pytest.param("openvino", marks=pytest.mark.slow)])
def sdxl(request, sdxl_onnx_dir, sdxl_dir):
    with EditPipeline(sdxl_onnx_dir, sdxl_dir, backend=request.param) as pipe:
        assert pipe.graph_set.backend == request.param
        yield pipe


@pytest.fixture(scope="module")
def sdxl_state(sdxl):
    return sdxl.generate_base(TEST_BASE)


@pytest.fixture(scope="module")
def diffusers_sdxl(sdxl_dir, diffusers_reference):
    # its own scheduler: SDXL's Euler config, edit-rt's default sampler for it (samplers.default_sampler)
    return diffusers_reference.pipe(sdxl_dir, sdxl=True)[0]


def _sdxl_reference(pipe, base: Base, latents: np.ndarray, **embeds) -> np.ndarray:
    """diffusers' image for ``base`` from ``latents`` (its prompts, or the embeddings given)."""
    prompts = {} if embeds else {"prompt": base.prompt, "negative_prompt": base.negative_prompt}
    return pipe(
        **prompts, **embeds, num_inference_steps=base.steps, guidance_scale=base.guidance, height=base.height,
        width=base.width, eta=0.0, latents=torch.from_numpy(latents), output_type="np",
        clip_skip=base.clip_skip or None,
        original_size=(base.original_height or base.height, base.original_width or base.width),
        crops_coords_top_left=(base.crop_top, base.crop_left), target_size=(base.height, base.width),
    ).images  # fmt: skip


# --- SDXL ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("graph", GRAPHS)
def test_sdxl_graph_matches_torch(graph, sdxl_onnx_dir, sdxl_dir):
    assert_graph_matches_torch(graph, sdxl_onnx_dir, sdxl_dir)


def test_sdxl_manifest_lists_the_step_inputs(sdxl_onnx_dir, sdxl_dir):
    manifest = load_manifest(sdxl_onnx_dir)
    roles = manifest.step_roles
    assert roles["cond_text_embeds"] == "row_cond:text_embeds" and roles["uncond_text_embeds"] == "set_cond:text_embeds"
    assert roles["time_ids"] == "row_cond:time_ids"
    specs = {t.name: t.shape for t in manifest.graphs["unet_step"].inputs}
    # the UNet's add_embedding takes pooled + 6 time ids: its width gives the pooled size
    unet_config = json.loads((sdxl_dir / "unet" / "config.json").read_text())
    pooled = unet_config["projection_class_embeddings_input_dim"] - 6 * unet_config["addition_time_embed_dim"]
    assert specs["cond_text_embeds"] == ["N", pooled] and specs["uncond_text_embeds"] == ["M", pooled]
    assert specs["time_ids"] == ["N", 6]
    assert manifest.family["family"] == "sdxl" and manifest.family["vae_force_upcast"] is True


@pytest.mark.parametrize(
    "change",
    [{}, {"negative_prompt": None, "guidance": 5.0}, {"negative_prompt": "", "guidance": 5.0},
     {"clip_skip": 1, "original_width": 64, "crop_top": 4}],
    # diffusers: no negative prompt (None) is zeros under force_zeros_for_empty_prompt, "" is encoded
    ids=["negative", "no-negative-is-zeros", "empty-negative-is-encoded", "clip-skip-and-sizes"],
)
def test_sdxl_generation_equals_diffusers(sdxl, sdxl_dir, diffusers_reference, change):
    base = dataclasses.replace(TEST_BASE, **change)
    noise = sdxl.initial_noise(base)
    ours = sdxl.decode(sdxl.generate_base(base, noise=noise).final_latent)
    # 1e-4 on images in [0, 1], as for SD (tests/test_pipeline.py); measured ~1e-6
    np.testing.assert_allclose(ours, diffusers_reference(sdxl_dir, base, noise, "own", sdxl=True), atol=1e-4)


def test_sdxl_edit_mixes_kv_and_pooled_with_its_strength(sdxl, diffusers_sdxl):
    """An edit from step 0 at strength s is a generation whose prompt embeddings *and* pooled
    embedding are base + s (edit - base) (K/V are linear in the embeddings): diffusers, fed
    those from its own encode_prompt, is the reference."""
    base, s = TEST_BASE, 0.6
    # words as long as the base's (in the byte-level test tokens): the tokens line up, and the
    # aligned mix is this position mix (insertions: tests/test_directions.py)
    edit = "a tan square on a gray background"
    noise = sdxl.initial_noise(base)
    state = sdxl.generate_base(base, noise=noise)
    (ours,) = sdxl.run_tail(state, [TailRow(edit, s, 0, base.guidance)])
    encode = diffusers_sdxl.encode_prompt
    with torch.no_grad():
        emb_b, neg, pool_b, neg_pool = encode(base.prompt, negative_prompt=base.negative_prompt)
        emb_e, _, pool_e, _ = encode(edit, negative_prompt=base.negative_prompt)
    embeds = {"prompt_embeds": emb_b + s * (emb_e - emb_b), "pooled_prompt_embeds": pool_b + s * (pool_e - pool_b),
              "negative_prompt_embeds": neg, "negative_pooled_prompt_embeds": neg_pool}  # fmt: skip
    expected = _sdxl_reference(diffusers_sdxl, base, noise, **embeds)
    np.testing.assert_allclose(sdxl.decode(ours[None]), expected, atol=1e-4)
    # and the pooled embedding matters: mixing K/V alone would give another image
    embeds["pooled_prompt_embeds"] = pool_b
    assert np.abs(_sdxl_reference(diffusers_sdxl, base, noise, **embeds) - expected).max() > 1e-3


@pytest.mark.parametrize("start_step", [0, 4, 9])
def test_sdxl_identity_edits_reproduce_the_base(sdxl, sdxl_state, start_step):
    rows = [TailRow("something else entirely", 0.0, start_step, TEST_BASE.guidance),
            TailRow(TEST_BASE.prompt, 1.0, start_step, TEST_BASE.guidance)]  # fmt: skip
    for final in sdxl.run_tail(sdxl_state, rows):
        np.testing.assert_allclose(final, sdxl_state.final_latent[0], atol=BATCH_ATOL)


def test_sdxl_batched_edits_equal_edits_one_at_a_time(sdxl, sdxl_state):
    g = TEST_BASE.guidance
    rows = [
        TailRow("a blue square", 1.0, 4, g),
        TailRow("a green circle", 0.5, 7, 3.0),
        TailRow("a yellow triangle", 1.0, 4, g, mask=Mask(0, 0, 16, 16)),
        TailRow("a blue square", 1.0, 6, g, seed=11),
    ]
    batched = sdxl.run_tail(sdxl_state, rows)
    for row, final in zip(rows, batched):
        (alone,) = sdxl.run_tail(sdxl_state, [row])
        np.testing.assert_allclose(final, alone, atol=BATCH_ATOL)
        assert np.abs(final - sdxl_state.final_latent[0]).max() > 1e-2


def test_sdxl_masked_edit_keeps_the_base_outside(sdxl, sdxl_state):
    (final,) = sdxl.run_tail(sdxl_state, [TailRow("a yellow triangle", 1.0, 3, TEST_BASE.guidance, mask=Mask(8, 0, 16, 16))])
    base = sdxl_state.final_latent[0]
    outside = np.ones(final.shape[1:], dtype=bool)
    outside[0:8, 4:12] = False
    np.testing.assert_array_equal(final[:, outside], base[:, outside])
    assert np.abs(final[:, ~outside] - base[:, ~outside]).max() > 1e-2


def test_sdxl_store_bytes_and_round_trip(sdxl, sdxl_state, sdxl_dir, tmp_path):
    """A stored SDXL base's tensors weigh what export/base_bytes computes from the UNet config
    (the README's table for real models uses the same formula), and come back whole."""
    from safetensors import safe_open

    from edit_rt.export.compile.base_bytes import base_bytes, kv_widths
    from edit_rt.runtime.storage.store import BaseStore

    for precision in ("fp32", "int8"):
        folder = tmp_path / precision
        store = BaseStore(sdxl.manifest.fingerprint, 64 << 20, folder, 64 << 20, precision, precision)
        bid = store.put(sdxl_state)
        unet_config = json.loads((sdxl_dir / "unet" / "config.json").read_text())
        config = {k: unet_config[k] for k in ("block_out_channels", "layers_per_block", "attention_head_dim",
                  "cross_attention_dim", "transformer_layers_per_block", "use_linear_projection", "down_block_types",
                  "up_block_types", "addition_embed_type", "addition_time_embed_dim", "projection_class_embeddings_input_dim")}  # fmt: skip
        pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
        expected = base_bytes(kv_widths(config), sdxl_state.latents.shape[1:], TEST_BASE.steps, 0, precision, precision, pooled)

        def tensor_bytes(path: Path) -> int:
            with safe_open(str(path), "np") as f:
                return sum(f.get_tensor(k).nbytes for k in f.keys())

        assert tensor_bytes(folder / "bases" / f"{bid}.safetensors") == expected.per_base
        (uncond,) = (folder / "uncond").glob("*.safetensors")
        assert tensor_bytes(uncond) == expected.uncond_kv
        restarted = BaseStore(sdxl.manifest.fingerprint, 64 << 20, folder, 64 << 20, precision, precision)
        back = restarted.get(bid)
        np.testing.assert_array_equal(back.cond_kv.extras["text_embeds"], sdxl_state.cond_kv.extras["text_embeds"])
        np.testing.assert_array_equal(back.uncond_kv.extras["text_embeds"], sdxl_state.uncond_kv.extras["text_embeds"])
        if precision == "fp32":  # an edit of the reloaded base is the edit of the original
            row = TailRow("a blue square", 0.7, 5, TEST_BASE.guidance)
            np.testing.assert_array_equal(sdxl.run_tail(back, [row])[0], sdxl.run_tail(sdxl_state, [row])[0])


def test_server_serves_sdxl(tmp_path, sdxl_dir, sdxl_onnx_dir, diffusers_sdxl):
    base = {"prompt": "x", "steps": 6, "guidance": 7.5, "width": 32, "height": 32}
    server = ServerProcess(tmp_path, sdxl_dir, sdxl_onnx_dir, base=base)
    try:
        body = {"prompt": "a red circle", "negative_prompt": "blurry", "seed": 4, "original_width": 64, "crop_left": 2}
        r = httpx.post(server.url + "/v1/images/generations", json=body, timeout=120)
        assert r.status_code == 200, r.text
        gen = r.json()
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(gen["data"][0]["b64_json"]))), dtype=np.int16)
        expected_base = Base(prompt="a red circle", negative_prompt="blurry", seed=4, steps=6, guidance=7.5, width=32,
                             height=32, original_width=64, crop_left=2)  # fmt: skip
        with EditPipeline(sdxl_onnx_dir, sdxl_dir) as pipe:
            noise = pipe.initial_noise(expected_base)
        expected = to_uint8(_sdxl_reference(diffusers_sdxl, expected_base, noise)[0]).astype(np.int16)
        assert np.abs(image - expected).max() <= 1
        edits = [{"prompt": "a blue square", "tail_steps": 3}, {"prompt": "a green circle", "strength": 0.5, "tail_steps": 4}]
        r = httpx.post(server.url + "/v1/images/edits", json={"base_id": gen["id"], "edits": edits}, timeout=120)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 2
        r = httpx.post(server.url + "/v1/images/generations", json={"prompt": "x", "clip_skip": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "clip_skip"  # SDXL's tiny encoders: 0 or 1
    finally:
        assert server.stop()


# --- SD 1.x / 2.x details ------------------------------------------------------------------------


def _sd_reference(pipe, base: Base, noise: np.ndarray) -> np.ndarray:
    """``StableDiffusionPipeline`` + DDIM; with clip_skip, the embeddings formed by diffusers'
    rule (``encode_prompt``: ``hidden_states[-(clip_skip + 1)]`` through the final layer norm;
    the negative prompt's last hidden state) and passed in, since diffusers' own clip_skip path
    reads ``text_encoder.text_model``, which transformers 5's CLIPTextModel no longer has."""
    embeds: dict = {"prompt": base.prompt, "negative_prompt": base.negative_prompt}
    if base.clip_skip:
        def ids(text: str) -> torch.Tensor:
            return pipe.tokenizer([text], padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids

        encoder = pipe.text_encoder
        with torch.no_grad():
            hidden = encoder(ids(base.prompt), output_hidden_states=True).hidden_states[-(base.clip_skip + 1)]
            norm = getattr(encoder, "text_model", encoder).final_layer_norm
            embeds = {"prompt_embeds": norm(hidden), "negative_prompt_embeds": encoder(ids(base.negative_prompt))[0]}
    return pipe(**embeds, num_inference_steps=base.steps, guidance_scale=base.guidance, height=base.height,
                width=base.width, eta=0.0, latents=torch.from_numpy(noise), output_type="np").images  # fmt: skip


def _sd_pipeline(model_dir: Path, **load) -> StableDiffusionPipeline:
    pipe = StableDiffusionPipeline.from_pretrained(model_dir, **load)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_clip_skip_equals_diffusers(pipeline, model_dir):
    reference = _sd_pipeline(model_dir)
    base = dataclasses.replace(TEST_BASE, clip_skip=1)
    noise = pipeline.initial_noise(base)
    ours = pipeline.decode(pipeline.generate_base(base, noise=noise).final_latent)
    expected = _sd_reference(reference, base, noise)
    np.testing.assert_allclose(ours, expected, atol=1e-4)
    unskipped = pipeline.decode(pipeline.generate_base(TEST_BASE, noise=noise).final_latent)
    assert np.abs(unskipped - expected).max() > 1e-3  # the layer choice is visible


@pytest.mark.parametrize("backend", ["ort-cpu", pytest.param("openvino", marks=pytest.mark.slow)])  # as the sdxl fixture
def test_sd2_generation_equals_diffusers_and_its_scores_are_pinned_fp32(sd2_dir, sd2_onnx_dir, backend):
    """v-prediction, upcast_attention, linear projections, GELU text encoder, clip_skip; and
    the nodes an fp16 engine keeps fp32 are exactly the attentions' score chains."""
    from edit_rt.export.compile.engines import fp32_attention_nodes
    from edit_rt.export.compile.graphs import cross_attention_layers

    reference = _sd_pipeline(sd2_dir)
    assert reference.unet.config.upcast_attention and reference.scheduler.config.prediction_type == "v_prediction"
    with EditPipeline(sd2_onnx_dir, sd2_dir, backend=backend) as pipe:
        assert pipe.family["upcast_attention"] is True and pipe.graph_set.backend == backend
        for base in (TEST_BASE, dataclasses.replace(TEST_BASE, clip_skip=2)):
            noise = pipe.initial_noise(base)
            ours = pipe.decode(pipe.generate_base(base, noise=noise).final_latent)
            np.testing.assert_allclose(ours, _sd_reference(reference, base, noise), atol=1e-4)
    # every self-attention has one softmax, every cross-attention two (uncond sets, cond rows)
    attentions = [n for n, m in reference.unet.named_modules() if n.endswith(("attn1", "attn2"))]
    cross = len(cross_attention_layers(reference.unet))
    pinned = fp32_attention_nodes(sd2_onnx_dir / "unet_step.onnx")
    import onnx

    graph = onnx.load(str(sd2_onnx_dir / "unet_step.onnx"), load_external_data=False).graph
    ops = {node.name: node.op_type for node in graph.node}
    assert sum(ops[n] == "Softmax" for n in pinned) == len(attentions) - cross + 2 * cross
    assert sum(ops[n] == "MatMul" for n in pinned) == sum(ops[n] == "Softmax" for n in pinned)  # each its q k^T


def test_engine_precision_keeps_sdxl_vae_fp32(sdxl_onnx_dir, onnx_dir):
    from edit_rt.runtime.engine.engines import graph_precision, upcasts

    sdxl_manifest, sd_manifest = load_manifest(sdxl_onnx_dir), load_manifest(onnx_dir)
    # latent_blend only selects fp32 latents: fp32 everywhere
    assert [graph_precision(sdxl_manifest, g, "fp16") for g in GRAPHS] == ["fp16"] * 3 + ["fp32"] * 3
    assert [graph_precision(sd_manifest, g, "fp16") for g in GRAPHS] == ["fp16"] * 3 + ["fp32"] + ["fp16"] * 2
    assert not upcasts(sd_manifest, "unet_step") and not upcasts(sdxl_manifest, "unet_step")


# --- loading: variants and fp16 weights ------------------------------------------------------------


def _export_cli(tmp_path: Path, model: Path, **export) -> Ran:
    """`edit-rt export` of ``model`` in this process, as the console script runs it (tests/cli_in_process.py)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / f"{model.name}.yaml"
    config.write_text(yaml.safe_dump({"model": str(model), "build_dir": str(tmp_path / "build"), "export": export,
                                      "base": {"prompt": "x", "width": 32, "height": 32}}))  # fmt: skip
    return edit_rt("export", str(config))


def _one_line(result: Ran) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def _fp16_copy(model_dir: Path, out: Path, variant: str | None) -> Path:
    """The tiny SD's weights saved in fp16 (as a variant, or under the default file names)."""
    pipe = StableDiffusionPipeline.from_pretrained(model_dir, torch_dtype=torch.float16)
    pipe.save_pretrained(str(out), safe_serialization=True, variant=variant)
    return out


@pytest.mark.parametrize("variant", [pytest.param("fp16", marks=pytest.mark.slow), None], ids=["variant-fp16", "fp16-default-names"])
def test_fp16_weights_export_and_equal_diffusers(model_dir, tmp_path, variant):
    folder = _fp16_copy(model_dir, tmp_path / "fp16-sd", variant)
    if variant:  # without export.variant, one line that names the setting
        line = _one_line(_export_cli(tmp_path / "plain", folder))
        assert "only fp16 variant weights" in line and "set export.variant: fp16" in line
    result = _export_cli(tmp_path, folder, **({"variant": variant} if variant else {}))
    assert result.returncode == 0, result.stderr
    onnx_dir = tmp_path / "build" / "fp16-sd" / "onnx"
    assert load_manifest(onnx_dir).data["model"]["variant"] == variant
    with EditPipeline(onnx_dir, folder) as pipe:
        noise = pipe.initial_noise(TEST_BASE)
        ours = pipe.decode(pipe.generate_base(TEST_BASE, noise=noise).final_latent)
    reference = _sd_pipeline(folder, variant=variant, torch_dtype=torch.float32)  # diffusers' own fp16 -> fp32
    np.testing.assert_allclose(ours, _sd_reference(reference, TEST_BASE, noise), atol=1e-4)


# --- refusals -------------------------------------------------------------------------------------


def _folder_like(model_dir: Path, out: Path, index: dict | None = None, scheduler: dict | None = None) -> Path:
    """A copy of the tiny SD folder with another model_index.json or scheduler config."""
    import shutil

    shutil.copytree(model_dir, out)
    if index is not None:
        (out / "model_index.json").write_text(json.dumps(index))
    if scheduler is not None:
        config = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
        (out / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config, **scheduler}))
    return out


def _transformer_folder(out: Path, pipeline_class: str, scheduler: str) -> Path:
    """A pipeline folder without a UNet (SD3, Flux, PixArt): index, scheduler and transformer config."""
    for part in ("transformer", "scheduler", "vae"):
        (out / part).mkdir(parents=True)
    (out / "model_index.json").write_text(json.dumps({"_class_name": pipeline_class, "transformer": ["diffusers", "X"],
                                                      "scheduler": ["diffusers", scheduler]}))  # fmt: skip
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": scheduler}))
    (out / "transformer" / "config.json").write_text("{}")
    return out


REFUSALS = {
    # (LCM, TCD and Turbo folders run: tests/test_few_step.py)
    "flow-scheduler": ({"scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler"}}, "FlowMatchEulerDiscreteScheduler"),
    "sd3": (("StableDiffusion3Pipeline", "FlowMatchEulerDiscreteScheduler"), "StableDiffusion3Pipeline"),
    "flux": (("FluxPipeline", "FlowMatchEulerDiscreteScheduler"), "FluxPipeline"),
    "pixart": (("PixArtAlphaPipeline", "DPMSolverMultistepScheduler"), "PixArtAlphaPipeline"),
    "inpainting": ({"index": "StableDiffusionInpaintPipeline"}, "StableDiffusionInpaintPipeline"),
}  # fmt: skip


# two kinds in the default run (a scheduler class, a pipeline class); every kind in make test-all
@pytest.mark.parametrize("kind", [k if k in ("flow-scheduler", "sd3") else pytest.param(k, marks=pytest.mark.slow) for k in REFUSALS])
def test_unsupported_families_are_refused_in_one_line(kind, model_dir, tmp_path):
    spec, named = REFUSALS[kind]
    out = tmp_path / kind
    if isinstance(spec, tuple):
        folder = _transformer_folder(out, *spec)
    elif "index" in spec:
        index = json.loads((model_dir / "model_index.json").read_text())
        folder = _folder_like(model_dir, out, index={**index, "_class_name": spec["index"]})
    else:
        folder = _folder_like(model_dir, out, scheduler=spec["scheduler"])
    line = _one_line(_export_cli(tmp_path, folder))
    assert named in line and str(folder) in line
    assert "StableDiffusionPipeline" in line or "DDIM" in line  # and what is supported
    assert not (tmp_path / "build").exists() or not any((tmp_path / "build").rglob("*.onnx"))
