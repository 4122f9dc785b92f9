"""DeepCache over an edit's tail and a generation (issue 37, item 2): ``tail.deepcache`` /
``base.deepcache`` k runs every k-th step full and the others on the outer blocks alone, fed the
deep features of the last full step (export/compile/graphs.py's UNetShallowStepGraph, loop/row_scheduler.py).

The reference is written here from diffusers' own blocks (conv_in, the time embedding, the
first down block, the last up block, conv_out, called directly) and its DDIMScheduler, not
from the code under test: a tail with k equals it; k = 1 is today's tail; a mask keeps its
base's pixels; bad values are refused naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edit_rt.runtime.config.load import load_config
from edit_rt.runtime.errors import ConfigError
from edit_rt.runtime.model.edit import Edit, Mask, TailRow

from .conftest import TEST_BASE

EDIT = "a green circle on a blue background"
ATOL = 1e-5  # ONNX Runtime's rows against its own (test_pipeline's BATCH_ATOL)
REFERENCE_ATOL = 5e-5  # against torch over <= 6 steps (test_uncond_reuse.py says why)


def _unet(unet, x: torch.Tensor, t, text: torch.Tensor, feature=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(prediction, deep features): ``feature`` None: diffusers' whole forward, the features
    entering the last up block caught by a hook; else the DeepCache shallow forward on them."""
    if feature is None:
        caught = []
        hook = unet.up_blocks[-2].register_forward_hook(lambda module, args, out: caught.append(out))
        try:
            return unet(x, t, encoder_hidden_states=text).sample, caught[0]
        finally:
            hook.remove()
    emb = unet.time_embedding(unet.time_proj(t.expand(x.shape[0])).to(x.dtype))
    h = unet.conv_in(x)
    skips = (h,)
    first = unet.down_blocks[0]
    for resnet, attention in zip(first.resnets, first.attentions):  # its downsampler feeds only deeper blocks
        h = attention(resnet(h, emb), encoder_hidden_states=text, return_dict=False)[0]
        skips += (h,)
    h = unet.up_blocks[-1](hidden_states=feature, res_hidden_states_tuple=skips, temb=emb, encoder_hidden_states=text)
    return unet.conv_out(unet.conv_act(unet.conv_norm_out(h))), feature


def _reference_tail(pipe, state, prompt: str, start: int, k: int) -> np.ndarray:
    """diffusers' UNet with classifier-free guidance and DDIM from x_b(start): tail steps 0, k,
    2k, ... full, the others shallow on the last full step's features of each half."""
    with torch.no_grad():
        cond, uncond = pipe.encode_prompt(prompt, "cpu", 1, True, TEST_BASE.negative_prompt)
        text = torch.cat([uncond, cond])
        pipe.scheduler.set_timesteps(TEST_BASE.steps)
        x = torch.from_numpy(state.latent(start).copy())
        feature = None
        for j, i in enumerate(range(start, TEST_BASE.steps)):
            t = pipe.scheduler.timesteps[i]
            pred, feature = _unet(pipe.unet, torch.cat([x, x]), t, text, None if j % k == 0 else feature)
            u, c = pred.chunk(2)
            x = pipe.scheduler.step(u + TEST_BASE.guidance * (c - u), t, x, eta=0.0).prev_sample
    return x[0].numpy()


@pytest.mark.parametrize("k", [2, 3])
def test_a_deepcache_tail_equals_diffusers_blocks_run_deepcache_style(pipeline, base_state, diffusers_pipe, k):
    """Two rows of one edit entering together share every call; a third row of another prompt
    entering later (a join makes the next call full) is held to today's tail where it runs full."""
    g = TEST_BASE.guidance
    rows = [TailRow(EDIT, 1.0, 4, g, deepcache=k), TailRow("a blue square", 1.0, 4, g, deepcache=k)]
    scheduler = pipeline.batcher(base_state.latents.shape[1:]).scheduler
    before = scheduler.stats.shallow_calls
    finals = pipeline.run_tail(base_state, rows)
    steps = TEST_BASE.steps - 4
    assert scheduler.stats.shallow_calls - before == steps - len(range(0, steps, k))
    for row, final in zip(rows, finals):
        expected = _reference_tail(diffusers_pipe, base_state, row.prompt, 4, k)
        np.testing.assert_allclose(final, expected, rtol=1e-5, atol=REFERENCE_ATOL)
    # shallow steps are an approximation: the exact tail differs
    (exact,) = pipeline.run_tail(base_state, [TailRow(EDIT, 1.0, 4, g)])
    assert np.abs(finals[0] - exact).max() > 1e-3


def test_deepcache_1_is_todays_tail(pipeline, base_state):
    g = TEST_BASE.guidance
    scheduler = pipeline.batcher(base_state.latents.shape[1:]).scheduler
    before = scheduler.stats.shallow_calls
    (one,) = pipeline.run_tail(base_state, [TailRow(EDIT, 1.0, 4, g, deepcache=1)])
    (plain,) = pipeline.run_tail(base_state, [TailRow(EDIT, 1.0, 4, g)])
    assert scheduler.stats.shallow_calls == before
    np.testing.assert_array_equal(one, plain)


def test_a_row_that_is_due_makes_the_call_full(pipeline, base_state, diffusers_pipe):
    """A k = 3 row beside a k = 1 row (today's tail) runs full at every step: it equals the
    exact tail of its prompt."""
    g = TEST_BASE.guidance
    scheduler = pipeline.batcher(base_state.latents.shape[1:]).scheduler
    before = scheduler.stats.shallow_calls
    finals = pipeline.run_tail(base_state, [TailRow(EDIT, 1.0, 4, g, deepcache=3), TailRow("a blue square", 1.0, 4, g)])
    assert scheduler.stats.shallow_calls == before
    np.testing.assert_allclose(finals[0], _reference_tail(diffusers_pipe, base_state, EDIT, 4, 1), rtol=1e-5, atol=REFERENCE_ATOL)


def test_a_masked_deepcache_row_keeps_its_base_outside_the_mask(pipeline, base_state):
    g = TEST_BASE.guidance
    row = TailRow("a yellow triangle", 1.0, 4, g, mask=Mask(0, 0, 16, 16), deepcache=2)
    (final,) = pipeline.run_tail(base_state, [row])
    keep = pipeline.keep_mask(row.mask, final.shape)[0]
    np.testing.assert_array_equal(final[:, keep], base_state.latent(TEST_BASE.steps)[0][:, keep])
    assert np.abs(final[:, ~keep] - base_state.latent(TEST_BASE.steps)[0][:, ~keep]).max() > 1e-2


def test_a_generation_with_deepcache_is_recorded_and_its_edits_run(pipeline):
    """``base.deepcache``: the generation's own steps run DeepCache's pattern, and its store
    record is the chain it ran (an identity edit of it at k = 1 from any step is its latent)."""
    import dataclasses

    base = dataclasses.replace(TEST_BASE, deepcache=2)
    scheduler = pipeline.batcher((4, 16, 16)).scheduler
    before = scheduler.stats.shallow_calls
    state = pipeline.generate_base(base)
    assert scheduler.stats.shallow_calls - before == TEST_BASE.steps // 2
    exact = pipeline.generate_base(TEST_BASE)
    assert np.abs(state.latent(TEST_BASE.steps) - exact.latent(TEST_BASE.steps)).max() > 1e-3


@pytest.mark.parametrize("value", [0, 17, "2", 1.5])
def test_a_bad_deepcache_is_refused_naming_the_field(tmp_path, value):
    with pytest.raises(Exception, match="deepcache"):
        Edit(prompt="x", deepcache=value)
    config = tmp_path / "c.yaml"
    config.write_text(f"model: m\nbase:\n  prompt: p\ntail:\n  deepcache: {value!r}\n")
    with pytest.raises(ConfigError, match=r"tail\.deepcache"):
        load_config(config)


def test_deepcache_with_preserve_auto_and_structure_keeping(pipeline, base_state):
    """A ``preserve: auto`` row's map-collecting steps run full (the shallow graph has no maps),
    then shallow; a structure-keeping row's reference row shares its pattern. Outside its mask
    an auto row keeps its base's latent exactly, DeepCache or not."""
    g = TEST_BASE.guidance
    scheduler = pipeline.batcher(base_state.latents.shape[1:]).scheduler
    before = (scheduler.stats.shallow_calls, scheduler.stats.map_calls)
    auto = TailRow(EDIT, 1.5, 3, g, preserve="auto", deepcache=2)
    (final,) = pipeline.run_tail(base_state, [auto])
    shallow, maps = scheduler.stats.shallow_calls - before[0], scheduler.stats.map_calls - before[1]
    assert maps == pipeline.preservation.preserve.steps and shallow == len(range(maps, TEST_BASE.steps - 3, 2))  # after the last map step
    keep = pipeline.auto_mask(TEST_BASE.prompt, auto, final.shape)[0]
    assert keep is not None
    before = scheduler.stats.shallow_calls
    kept = TailRow(EDIT, 1.0, 4, g, structure=0.5, deepcache=2)
    (structured,) = pipeline.run_tail(base_state, [kept])
    # tail steps 1 and 4 of 6: the reference row leaves after step 2 (structure 0.5), so step 3 is full
    assert scheduler.stats.shallow_calls - before == 2
    (exact,) = pipeline.run_tail(base_state, [TailRow(EDIT, 1.0, 4, g, structure=0.5)])
    assert 0 < np.abs(structured - exact).max() < np.abs(exact).max()
