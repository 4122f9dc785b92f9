"""The Python API (runtime/apps/editor.py) as docs/python.md shows it, and the CLI's host/token rule.

Every ```python block of docs/python.md (and the README's) runs, in order, against the tiny
test model with configs/demo.yaml's settings; the results are checked against references that
are not the Editor: diffusers' StableDiffusionPipeline for the base (the documented noise: numpy
PCG64, standard normal), sd-parsers for the PNG parameters, and `edit-rt run` (run_config, the
CLI's door) for the config's edits, which also finds the Editor's base in the shared store.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from .cli_in_process import edit_rt
from .server_process import serve_to_its_end

ROOT = Path(__file__).resolve().parents[1]


def _blocks(path: Path, under: str = "") -> list[str]:
    """The ```python blocks of a markdown file (only those of section ``under``, when given)."""
    text = path.read_text()
    if under:
        text = text.split(f"\n## {under}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _substituted(code: str, places: dict[str, str]) -> str:
    for old, new in places.items():
        code = code.replace(old, new)
    return code


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory, model_dir, onnx_dir) -> Path:
    """configs/demo.yaml with the tiny test model in place of the shapes model."""
    tmp = tmp_path_factory.mktemp("python-api")
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg.update(model=str(model_dir), build_dir=str(onnx_dir.parent.parent), output_dir=str(tmp / "run"), backend="ort-cpu")
    # the shapes model's sliders fit only the shapes model: its sweeps go with them
    cfg.pop("adapters", None), cfg.pop("export", None)
    cfg["edits"] = [e for e in cfg["edits"] if "sweep" not in e]
    cfg["store"]["disk_dir"] = str(tmp / "bases")
    path = tmp / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def docs_run(demo_config, model_dir, onnx_dir) -> tuple[dict, str]:
    """Run every example of docs/python.md, then the README's, in the config's folder: the
    namespace they leave and what they printed."""
    places = {'"configs/demo.yaml"': repr(str(demo_config)), '"export/models/shapes-sd"': repr(str(model_dir)),
              'build_dir="build"': f"build_dir={str(onnx_dir.parent.parent)!r}"}  # fmt: skip
    plans = _blocks(ROOT / "docs" / "python.md", "Plans")  # a planner's (tests/test_plan_model.py runs them)
    docs = [b for b in _blocks(ROOT / "docs" / "python.md") if b not in plans]
    readme = _blocks(ROOT / "README.md", "Python API")
    assert len(docs) >= 8 and len(readme) == 1
    for old in places:  # the places the test swaps must be in the docs, or the docs drifted
        assert old in "".join(docs), old
    namespace: dict = {}
    printed = io.StringIO()
    here = os.getcwd()
    os.chdir(demo_config.parent)
    try:
        with contextlib.redirect_stdout(printed):
            for code in docs:
                exec(compile(_substituted(code, places), "docs/python.md", "exec"), namespace)
            exec(compile(_substituted(readme[0], places), "README.md", "exec"), {})
    finally:
        os.chdir(here)
    return namespace, printed.getvalue()


def test_every_docs_example_runs_and_does_what_it_says(docs_run, demo_config):
    ns, printed = docs_run
    base, edits = ns["base"], ns["edits"]
    assert [e.index for e in edits] == [0, 1, 2] and edits[2].label == "yellow, masked"
    # the config's defaults filled in: cache.default_strength 1.5, default_tail_fraction 0.4 of 30
    assert (edits[0].strength, edits[0].tail_steps) == (1.5, 12) and (edits[1].strength, edits[2].tail_steps) == (0.5, 9)
    assert edits[2].fields["Edit mask"] == "0 0 16x16" and edits[2].fields["Start step"] == "21"
    assert "edits[0].strength less_than_equal edits[0].strength: must lie in [-4, 4], got 9.0\n" in printed
    assert "edit 0: step 12 of 12\n" in printed  # on_progress: every step of the 12-step default tail
    assert "True ram\nFalse\n" in printed  # the store: the base there, the deleted one gone
    assert "[3, 6, 9]\n" in printed and [im.size for _, im in ns["previews"]] == [(32, 32)] * 3
    assert sorted(p.name for p in demo_config.parent.glob("preview_*.png")) == ["preview_10.png", "preview_20.png"]
    masked = ns["masked"].array
    assert np.array_equal(masked[16:], base.array[16:]) and not np.array_equal(masked[:16], base.array[:16])
    assert ns["square"].seed != base.seed
    assert ns["photo"].fields["Inverted from"].startswith("sha256:") and ns["recoloured"][0].base_id == ns["photo"].base_id
    folder = demo_config.parent
    assert Image.open(folder / "base.png").text["parameters"] == base.parameters
    assert (folder / "edit_02.png").read_bytes() == edits[2].png and (folder / "green.png").is_file()


def test_base_equals_diffusers_from_the_documented_noise(docs_run, model_dir):
    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    ns, _ = docs_run
    b = ns["ed"].config.base
    pipe = StableDiffusionPipeline.from_pretrained(model_dir)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    shape = (1, pipe.unet.config.in_channels, b.height // pipe.vae_scale_factor, b.width // pipe.vae_scale_factor)
    noise = np.random.default_rng(b.seed).standard_normal(shape, dtype=np.float32)
    expected = pipe(b.prompt, negative_prompt=b.negative_prompt, num_inference_steps=b.steps, guidance_scale=b.guidance,
                    height=b.height, width=b.width, eta=0.0, latents=torch.from_numpy(noise),
                    output_type="np").images[0]  # fmt: skip
    # the PNG is uint8: images equal to 1e-4 (test_pipeline.py) round to within one level
    ours = ns["base"].array.astype(int)
    assert np.abs(ours - (np.clip(expected, 0, 1) * 255).round().astype(int)).max() <= 1
    assert ns["base"].seed == b.seed and ns["base"].fields["Seed"] == str(b.seed)


def test_png_parameters_read_by_sd_parsers(docs_run):
    from sd_parsers import ParserManager

    ns, _ = docs_run
    b = ns["ed"].config.base
    for result, prompt in ((ns["base"], b.prompt), (ns["edits"][1], "a green circle on a blue background, top left")):
        info = ParserManager().parse(Image.open(io.BytesIO(result.png)))
        (sampler,) = info.samplers
        assert sampler.name == "DDIM" and str(sampler.parameters["steps"]) == str(b.steps)
        assert str(sampler.parameters["seed"]) == str(b.seed) and float(sampler.parameters["cfg_scale"]) == b.guidance
        assert [p.value for p in sampler.prompts] == [prompt] and sampler.model.name == "tiny-sd"
    assert info.metadata["Edit strength"] == "0.5" and info.metadata["Base id"] == ns["base"].base_id


def test_config_edits_equal_edit_rt_run_which_finds_the_base_in_the_store(docs_run, demo_config):
    from edit_rt.runtime.config.load import load_config
    from edit_rt.runtime.apps.run import run_config

    ns, _ = docs_run
    cfg = load_config(demo_config)
    report = run_config(cfg)
    assert report["base_id"] == ns["base"].base_id and report["base_source"] == "store (disk)"
    run_base = Image.open(cfg.output_dir / "base.png")
    assert run_base.text["parameters"] == ns["base"].parameters
    assert np.array_equal(np.asarray(run_base.convert("RGB")), ns["base"].array)
    assert len(ns["config_edits"]) == len(cfg.edits) == 11
    for k, ours in enumerate(ns["config_edits"]):
        theirs = Image.open(cfg.output_dir / f"edit_{k:02d}.png")
        assert theirs.text["parameters"] == ours.parameters, k
        # the same rows in one batched tail; ONNX Runtime may reorder sums across the batch (1e-5)
        assert np.abs(np.asarray(theirs.convert("RGB"), dtype=int) - ours.array).max() <= 1, k
        assert ours.label == report["edits"][k]["label"]


def test_the_editor_closes_and_refuses_after(docs_run):
    import threading

    from edit_rt.runtime.errors import EditRtError

    ns, _ = docs_run
    assert not any(t.name == "edit-rt-editor" for t in threading.enumerate())  # both editors closed
    with pytest.raises(EditRtError, match="this Editor is closed"):
        ns["ed"].generate()


@pytest.fixture(scope="module")
def editor(demo_config):
    from edit_rt.runtime.apps.editor import Editor

    with Editor.from_config(demo_config) as ed:
        yield ed


@pytest.mark.parametrize("call,field,words", [
    (lambda ed, b: ed.edit(b, [{"prompt": "x", "colour": "red"}]), "edits[0].colour", "unknown field"),
    (lambda ed, b: ed.edit(b, ["x", {"strength": 1.0}]), "edits[1].prompt", "required field missing"),
    (lambda ed, b: ed.edit(b, ["x", {"prompt": "x", "tail_steps": 31}]), "edits[1].tail_steps", "outside the cache window"),
    (lambda ed, b: ed.edit(b, [3]), "edits[0]", "a prompt string, got int"),
    (lambda ed, b: ed.edit("0" * 24, ["x"]), "base_id", "never generated, deleted or evicted"),
    (lambda ed, b: ed.generate(seed="3"), "seed", "must be an integer"),
    (lambda ed, b: ed.generate(seed=-2), "seed", "(or -1 for a random seed)"),
    (lambda ed, b: ed.generate(steps=151), "steps", "at most 150"),
    (lambda ed, b: ed.generate("x" * 501), "prompt", "longer than 500 characters"),
    (lambda ed, b: ed.invert(np.full((32, 32, 3), 2.0)), "image", "values in [0, 1]"),
    (lambda ed, b: ed.invert("no-such.png"), "image", "cannot be read"),
    (lambda ed, b: ed.invert(b"not an image"), "image", ""),
    (lambda ed, b: ed.edit(b, [{"prompt": "x", "pixel_mask": np.ones((8, 8))}]), "edits[0].pixel_mask",
     "8x8, but the image is 32x32"),
    (lambda ed, b: ed.generate(size="64x64"), "size", "64x64 is not served"),
    (lambda ed, b: ed.generate(original_width=64), "original_width", "only SDXL models take size conditioning"),
    (lambda ed, b: ed.generate(previews=2), "previews", "without on_preview"),
    (lambda ed, b: ed.edit(b, ["x"], on_preview=print), "on_preview", "previews=0"),
])  # fmt: skip
def test_refusals_name_the_field(editor, call, field, words):
    from edit_rt.runtime.errors import EditorError

    base = editor.generate(steps=4)
    with pytest.raises(EditorError) as refused:
        call(editor, base)
    assert refused.value.field == field and words in str(refused.value)
    assert str(refused.value).startswith(field) and "\n" not in str(refused.value)


def test_an_unknown_argument_is_a_type_error(editor):
    with pytest.raises(TypeError):
        editor.generate("x", sampler_name="Euler a")


def test_a_missing_export_is_the_clis_one_line_error(tmp_path, model_dir, capfd):
    from edit_rt.runtime.apps.editor import Editor
    from edit_rt.runtime.errors import EditRtError

    with pytest.raises(EditRtError) as refused:
        Editor.from_model(model_dir, build_dir=tmp_path / "nothing", width=32, height=32)
    manifest = tmp_path / "nothing" / "tiny-sd" / "onnx" / "manifest.json"
    assert str(refused.value) == f"{manifest} not found; run `make export` (edit-rt export CONFIG) first"
    assert "Traceback" not in capfd.readouterr().err  # raised, not also logged with a traceback


def test_a_progress_callback_cannot_call_the_editor(editor):
    from edit_rt.runtime.errors import EditRtError

    base = editor.generate(steps=4)
    with pytest.raises(EditRtError, match="from an on_progress or on_preview callback"):
        editor.edit(base, ["x"], on_progress=lambda i, step, of: editor.generate())


def test_ctrl_c_takes_the_calls_rows_out_of_the_batch(editor):
    import signal
    import time

    import threading

    base = editor.generate(steps=60)
    interrupted = []
    main = threading.main_thread().ident
    # Python's own Ctrl-C handler (an earlier test's library may have left another in place)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupt(index, step, of):  # a real SIGINT, once the rows are in the step loop
        if not interrupted:
            interrupted.append(step)
            # to the main thread, as a terminal's Ctrl-C reaches a waiting script: a signal sent to
            # the process may land on this (the Editor's) thread, and the main thread's wait then
            # sees it only when the call has returned
            signal.pthread_kill(main, signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        editor.edit(base, ["x"] * 16, on_progress=interrupt)  # 16 rows x 24 steps: seconds, were it to run
    deadline = time.monotonic() + 10
    while editor.service.in_flight()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert interrupted and editor.service.in_flight() == {"running": 0, "queued": 0, "done": 0, "total": 0,
                                                           "started": None, "current": None}  # fmt: skip
    assert len(editor.edit(base, [{"prompt": "y", "tail_steps": 2}])) == 1  # the Editor goes on
    signal.signal(signal.SIGINT, previous)


def test_calls_from_threads_batch_and_equal_each_alone(editor):
    from concurrent.futures import ThreadPoolExecutor

    base = editor.generate(steps=8)
    prompts = [f"a {c} circle" for c in ("green", "blue", "white", "black")]
    alone = [editor.edit(base, [{"prompt": p, "tail_steps": 4}])[0].array for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: editor.edit(base, [{"prompt": p, "tail_steps": 4}])[0].array, prompts))
    for a, t in zip(alone, together):
        assert np.abs(a.astype(int) - t).max() <= 1


# --- the CLI's host/token rule ------------------------------------------------------------------


@pytest.fixture
def busy_port():
    """A port taken on every IPv4 address: a serve that passes the token rule stops at binding it
    (one line, before any engine loads), so the rule is seen without starting a server."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield s.getsockname()[1]


def test_serve_beyond_loopback_without_a_token_is_refused(demo_config, busy_port):
    r = serve_to_its_end(demo_config, "--host", "0.0.0.0", "--port", str(busy_port), env={"EDIT_RT_TOKEN": None})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: serve.host: 0.0.0.0 is not loopback and no token is set")
    assert "serve.token" in line and "EDIT_RT_TOKEN" in line and "--allow-no-token" in line


@pytest.mark.parametrize("args,env,warned", [
    (("--host", "0.0.0.0"), {"EDIT_RT_TOKEN": "s3cret"}, False),
    (("--host", "0.0.0.0", "--allow-no-token"), {"EDIT_RT_TOKEN": None}, True),
    (("--host", "127.0.0.1"), {"EDIT_RT_TOKEN": None}, False),
])  # fmt: skip
def test_serve_with_a_token_or_on_loopback_or_allowed_passes_the_rule(demo_config, busy_port, args, env, warned):
    r = edit_rt("serve", str(demo_config), *args, "--port", str(busy_port), env=env)  # the exit status's process: above
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"serve.port {busy_port} on {args[1]} is in use" in r.stderr and "no token is set" not in r.stderr
    assert ("WARNING: listening on 0.0.0.0 without a token (--allow-no-token)" in r.stderr) == warned
