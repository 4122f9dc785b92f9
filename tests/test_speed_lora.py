"""Speed LoRAs (LCM-LoRA, Hyper-SD, Lightning) as adapters, the schedule switched with them.

A config's ``adapters: {lcm: {path, sampler: lcm, steps: 4, guidance: ...}}`` declares the schedule
a LoRA was distilled for; a generation using it at a nonzero scale runs that schedule where the
config or the request sets none of its own. The reference is diffusers' LCM-LoRA recipe on the
same tiny model and a random UNet-only LoRA (what an LCM-LoRA is): ``StableDiffusionPipeline`` +
``LCMScheduler`` + ``load_lora_weights`` + ``set_adapters([name], [s])``, fed the same initial
latents and edit-rt's per-step noise (``ancestral_noise``, as tests/test_few_step.py feeds it).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import LCMScheduler, StableDiffusionPipeline
from diffusers.schedulers import scheduling_lcm

from edit_rt.export.compile.adapters import convert_adapters
from edit_rt.runtime.config.load import config_from_dict
from edit_rt.runtime.engine.manifest import load_manifest
from edit_rt.runtime.errors import ConfigError
from edit_rt.runtime.loop.jobs import Job, Request
from edit_rt.runtime.model.edit import Base, TailRow
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

from .conftest import TEST_BASE
from .test_adapters import make_lora
from .test_few_step import _draw

IMAGE_ATOL = 1e-4  # images in [0, 1], as tests/test_few_step.py
BATCH_ATOL = 1e-5  # fp32 reordering across batch sizes, as tests/test_few_step.py
SCALES = (0.6, 1.2)
# TEST_BASE's prompt, seed and size; its sampler, steps and guidance are the LoRA's to set
BASE = {"prompt": TEST_BASE.prompt, "negative_prompt": TEST_BASE.negative_prompt, "seed": TEST_BASE.seed,
        "width": TEST_BASE.width, "height": TEST_BASE.height}  # fmt: skip


@pytest.fixture(scope="module")
def lcm_lora(model_dir, tmp_path_factory) -> Path:
    """A UNet-only rank-8 LoRA, as the LCM-LoRAs are (random: the equality does not need a trained one)."""
    return make_lora(model_dir, tmp_path_factory.mktemp("lcm-lora"), seed=21, rank=8, alpha=8.0, text=False)


@pytest.fixture(scope="module")
def converted(model_dir, adapter_onnx_dir, lcm_lora) -> dict[str, Path]:
    return convert_adapters(model_dir, load_manifest(adapter_onnx_dir), {"lcm": lcm_lora}, adapter_onnx_dir.parent / "adapters")


@pytest.fixture(scope="module")
def pipe(adapter_onnx_dir, model_dir, converted):
    with EditPipeline(adapter_onnx_dir, model_dir, adapters=converted) as p:
        yield p


@pytest.fixture(scope="module")
def reference(model_dir, lcm_lora):
    """diffusers' LCM-LoRA recipe: the LoRA loaded, LCMScheduler (set_adapters picks the scale)."""
    ref = StableDiffusionPipeline.from_pretrained(model_dir)
    ref.scheduler = LCMScheduler.from_config(ref.scheduler.config)
    ref.load_lora_weights(str(lcm_lora), adapter_name="lcm")
    ref.set_progress_bar_config(disable=True)
    return ref


def _config(model_dir, adapter_onnx_dir, lcm_lora, schedule: dict, base: dict, **more):
    return config_from_dict({"model": str(model_dir), "build_dir": str(adapter_onnx_dir.parent.parent),
                             "adapters": {"lcm": {"path": str(lcm_lora), **schedule}},
                             "export": {"adapter_slots": 3, "adapter_rank": 8}, "base": {**BASE, **base}, **more})  # fmt: skip


def _diffusers(reference, base: Base, scale: float, latents: np.ndarray, monkeypatch) -> np.ndarray:
    reference.set_adapters(["lcm"], adapter_weights=[scale])
    _draw(monkeypatch, scheduling_lcm, base.seed)
    return reference(base.prompt, negative_prompt=base.negative_prompt, num_inference_steps=base.steps,
                     guidance_scale=base.guidance, height=base.height, width=base.width,
                     latents=torch.from_numpy(latents), output_type="np").images  # fmt: skip


def _generate(pipe: EditPipeline, bases: list[Base]):
    """``bases`` generated as rows of one batched call each step; their states, and the step
    calls and row-steps that took."""
    shape = pipe.latent_shape(bases[0])
    stats = pipe.batcher(shape).scheduler.stats
    before = dataclasses.replace(stats)
    request = Request(uuid.uuid4().hex, decode=False)
    jobs = [Job(request, k, b, TailRow(b.prompt, 1.0, 0, b.guidance), noise=pipe.initial_noise(b)) for k, b in enumerate(bases)]
    results = pipe.batcher(shape).run(request, jobs)
    return [r.state for r in results], stats.calls - before.calls, stats.row_steps - before.row_steps


@pytest.fixture(scope="module")
def lcm_bases(pipe, model_dir, adapter_onnx_dir, lcm_lora):
    """A config's base naming the LCM-LoRA (no sampler, steps or guidance of its own) at two
    scales, generated as two rows of one call."""
    cfg = _config(model_dir, adapter_onnx_dir, lcm_lora, {"sampler": "lcm", "steps": 4, "guidance": 1.5},
                  {"adapters": {"lcm": SCALES[0]}})  # fmt: skip
    bases = [cfg.base, dataclasses.replace(cfg.base, adapters={"lcm": SCALES[1]})]
    states, calls, row_steps = _generate(pipe, bases)
    return cfg, states, calls, row_steps


# --- against diffusers ------------------------------------------------------------------------------


def test_an_lcm_lora_at_two_scales_in_one_call_equals_diffusers_set_adapters(pipe, lcm_bases, reference, monkeypatch):
    cfg, states, calls, row_steps = lcm_bases
    assert (cfg.base.sampler, cfg.base.steps, cfg.base.guidance) == ("lcm", 4, 1.5)  # the LoRA's schedule
    assert (calls, row_steps) == (4, 8)  # both rows in every step's call
    images = [pipe.decode(s.final_latent) for s in states]
    for scale, state, ours in zip(SCALES, states, images):
        noise = pipe.initial_noise(state.base)
        np.testing.assert_allclose(ours, _diffusers(reference, state.base, scale, noise, monkeypatch), atol=IMAGE_ATOL)
    assert np.abs(images[0] - images[1]).max() > 1e-2  # the scale matters


def test_an_identity_edit_reproduces_an_lcm_lora_base(pipe, lcm_bases):
    """From every start step the tail re-enters the base's LCM chain (its LoRA scale, its noise)."""
    _, states, _, _ = lcm_bases
    for state in states:
        g, T = state.base.guidance, state.base.steps
        rows = [row for s in range(1, T) for row in (TailRow("a green square", 0.0, s, g), TailRow(state.base.prompt, 1.0, s, g))]
        for final in pipe.run_tail(state, rows):
            np.testing.assert_allclose(final, state.final_latent[0], atol=BATCH_ATOL)


@torch.no_grad()
def test_an_edit_with_its_own_scale_equals_diffusers_from_the_cached_latent(pipe, lcm_bases, reference, monkeypatch):
    """An edit row of the base at 0.6 taking the LCM-LoRA to 1.2 and one taking it off, from step 2:
    diffusers' UNet at that scale and LCMScheduler from the base's latent at step 2, its noise
    from step 2 on."""
    _, (state, _), _, _ = lcm_bases
    base, start = state.base, 2
    rows = [TailRow(base.prompt, 1.0, start, base.guidance, adapters={"lcm": (s, s)}) for s in (1.2, 0.0)]
    finals = pipe.run_tail(state, rows)
    cond, uncond = reference.encode_prompt(base.prompt, "cpu", 1, True, base.negative_prompt)
    for row, final in zip(rows, finals):
        reference.set_adapters(["lcm"], adapter_weights=[row.adapters["lcm"][1]])
        steps = iter(range(start, base.steps))  # the noise of the tail's steps: the base's from step 2 on
        monkeypatch.setattr(scheduling_lcm, "randn_tensor", lambda shape, **kw: torch.from_numpy(_noise(base.seed, next(steps), shape)))
        reference.scheduler.set_timesteps(base.steps)
        x = torch.from_numpy(state.latent(start))
        for t in reference.scheduler.timesteps[start:]:
            u, c = reference.unet(torch.cat([x, x]), t, encoder_hidden_states=torch.cat([uncond, cond])).sample.chunk(2)
            x = reference.scheduler.step(u + base.guidance * (c - u), t, x).prev_sample
        np.testing.assert_allclose(final, x[0].numpy(), atol=IMAGE_ATOL)
    assert np.abs(finals[0] - finals[1]).max() > 1e-2 and np.abs(finals[0] - state.final_latent[0]).max() > 1e-2


def _noise(seed: int, step: int, shape) -> np.ndarray:
    from edit_rt.runtime.loop.solver_slots import ancestral_noise

    return ancestral_noise(seed, step, np.empty(tuple(shape), np.float32))


# --- the schedule switched ------------------------------------------------------------------------


def test_a_config_naming_the_speed_lora_runs_its_schedule(pipe, model_dir, adapter_onnx_dir, lcm_lora, reference, monkeypatch, caplog):
    """No sampler, steps or guidance in the base: LCM at the LoRA's 4 steps and guidance 1 (one
    UNet half a step), as diffusers' recipe; what the base sets itself wins."""
    speed = {"sampler": "lcm", "steps": 4, "guidance": 1.0}
    cfg = _config(model_dir, adapter_onnx_dir, lcm_lora, speed, {"prompt": f"{BASE['prompt']} <lora:lcm:0.8>"})
    base = cfg.base
    assert (base.sampler, base.steps, base.guidance, base.adapters) == ("lcm", 4, 1.0, {"lcm": 0.8})
    stats = pipe.batcher(pipe.latent_shape(base)).scheduler.stats
    unguided = stats.unguided_row_steps
    noise = pipe.initial_noise(base)
    ours = pipe.decode(pipe.generate_base(base, noise=noise).final_latent)
    assert stats.unguided_row_steps - unguided == 4
    np.testing.assert_allclose(ours, _diffusers(reference, base, 0.8, noise, monkeypatch), atol=IMAGE_ATOL)

    own = _config(model_dir, adapter_onnx_dir, lcm_lora, speed, {"adapters": {"lcm": 1.0}, "steps": 2, "guidance": 2.0})
    assert (own.base.sampler, own.base.steps, own.base.guidance) == ("lcm", 2, 2.0)
    with caplog.at_level(logging.WARNING, logger="edit_rt.runtime.model.adapters"):
        ddim = _config(model_dir, adapter_onnx_dir, lcm_lora, speed, {"adapters": {"lcm": 1.0}, "sampler": "ddim"})
    assert (ddim.base.sampler, ddim.base.steps, ddim.base.guidance) == ("ddim", 4, 1.0)  # the explicit one, warned
    assert any("base.sampler: ddim runs as set" in r.getMessage() and "leave base.sampler out" in r.getMessage() for r in caplog.records)
    off = _config(model_dir, adapter_onnx_dir, lcm_lora, speed, {"adapters": {"lcm": 0.0}})
    assert (off.base.sampler, off.base.steps, off.base.guidance) == (None, 50, 7.5)  # at scale 0: Base's defaults
    plain = _config(model_dir, adapter_onnx_dir, lcm_lora, {}, {"adapters": {"lcm": 1.0}})  # a path alone: a plain LoRA
    assert (plain.base.sampler, plain.base.steps) == (None, 50) and plain.adapters["lcm"] == lcm_lora


def test_the_server_switches_each_requests_schedule(model_dir, adapter_onnx_dir, lcm_lora, converted):
    """The doors' generations (RequestFields.base_of): a request naming the speed LoRA runs its schedule
    where it sets none; one that leaves adapters out gets the config's base; one that takes
    the LoRA off gets the base as its file declares it."""
    from edit_rt.runtime.errors import RequestError
    from edit_rt.runtime.serving.service import Service

    cfg = _config(model_dir, adapter_onnx_dir, lcm_lora, {"sampler": "lcm", "steps": 4, "guidance": 1.0},
                  {"adapters": {"lcm": 1.0}}, store={"ram_mb": 16})  # fmt: skip
    service = Service(cfg)
    service.load()
    try:
        assert service.ready.is_set(), service.load_error
        ran = lambda b: (b.sampler, b.steps, b.guidance)  # noqa: E731
        assert ran(service.fields.base_of("x")) == ("lcm", 4, 1.0)  # the config's base
        assert ran(service.fields.base_of("x", adapters={"lcm": 0.5})) == ("lcm", 4, 1.0)
        assert ran(service.fields.base_of("x", adapters={"lcm": 0.5}, steps=2, guidance=1.5)) == ("lcm", 2, 1.5)
        assert ran(service.fields.base_of("x", adapters={"lcm": 0.5}, sampler="DDIM")) == ("ddim", 4, 1.0)
        assert ran(service.fields.base_of("x", adapters={})) == (service.fields.default_sampler, 50, 7.5)
        assert ran(service.fields.base_of("x", steps=3)) == ("lcm", 3, 1.0)
        with pytest.raises(RequestError, match="adapters.lcm: scale 9"):
            service.fields.base_of("x", adapters={"lcm": 9.0})
    finally:
        service.shutdown()


# --- bad entries ------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry,said", [
    ({"sampler": "lcm-turbo"}, "adapters.lcm.sampler: unknown sampler 'lcm-turbo'; edit-rt runs: ddim"),
    ({"steps": 0}, "adapters.lcm.steps: must lie in [1, 50], got 0"),
    ({"steps": 51}, "adapters.lcm.steps: must lie in [1, 50], got 51"),
    ({"guidance": 60.0}, "adapters.lcm.guidance: must lie in [0, 50], got 60.0"),
    ({"scheduler": "lcm"}, "adapters.lcm.scheduler: unknown key; the keys allowed here are guidance, path, sampler, steps"),
])  # fmt: skip
def test_a_bad_speed_entry_is_one_line_naming_the_field(model_dir, adapter_onnx_dir, lcm_lora, entry, said):
    with pytest.raises(ConfigError) as err:
        _config(model_dir, adapter_onnx_dir, lcm_lora, entry, {})
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_lcm_demo_runs_the_loras_schedule_on_the_demos_export():
    """configs/demo-lcm.yaml as committed: its base runs the LCM-LoRA's schedule, and its export
    settings are demo.yaml's (one export of the shapes model serves both demos)."""
    from edit_rt.runtime.config.load import load_config

    root = Path(__file__).resolve().parents[1] / "configs"
    lcm, demo = load_config(root / "demo-lcm.yaml"), load_config(root / "demo.yaml")
    assert (lcm.base.sampler, lcm.base.steps, lcm.base.guidance) == ("lcm", 4, 1.0)
    assert (lcm.export, lcm.engines, lcm.model, lcm.build_dir) == (demo.export, demo.engines, demo.model, demo.build_dir)
    assert lcm.adapters["lcm"] == root.parent / "export" / "models" / "shapes-sd" / "lcm-lora"


def test_two_speed_loras_with_different_schedules_are_refused_naming_the_base(model_dir, lcm_lora):
    cfg = {"model": str(model_dir), "adapters": {"lcm": {"path": str(lcm_lora), "sampler": "lcm", "steps": 4},
                                                  "tcd": {"path": str(lcm_lora), "sampler": "tcd", "steps": 4}},
           "base": {**BASE, "adapters": {"lcm": 1.0, "tcd": 0.5}}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"^base\.adapters: lcm and tcd are speed LoRAs with different schedules") as err:
        config_from_dict(cfg)
    assert "\n" not in str(err.value)
    cfg["base"]["adapters"]["tcd"] = 0.0  # one of them off: its schedule
    assert config_from_dict(cfg).base.sampler == "lcm"
