"""Shared fixtures: the tiny models built in this test session (SD 1.x, SDXL, SD 2.x), and their ONNX exports.

Nothing is downloaded: each model is built from a seed (edit_rt.export.world.tiny_model), exported
once per session per export setting, and every test compares against diffusers / PyTorch on those
same weights. Every test file shares these folders, so a test that needs a changed model or
build copies it first.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path
from typing import Callable

import pytest

from edit_rt.runtime.model.edit import Base

# 32x32 images = 16x16 latents with the tiny model's two-block VAE: big enough for two UNet
# resolutions, small enough that a 10-step generation takes well under a second.
TEST_BASE = Base(prompt="a red circle on a blue background", negative_prompt="blurry", seed=3,
                 steps=10, guidance=7.5, width=32, height=32)  # fmt: skip


def sample_rows(g: float = TEST_BASE.guidance) -> list:
    """Five edits of TEST_BASE that differ in every way a row can: start, strength, guidance,
    a mask, a seed (the backend tests run them on each backend)."""
    from edit_rt.runtime.model.edit import Mask, TailRow

    return [
        TailRow("a blue square", 1.0, 4, g),
        TailRow("a green circle", 0.5, 7, 3.0),
        TailRow("a green circle", 1.5, 2, g),
        TailRow("a yellow triangle", 1.0, 4, g, mask=Mask(0, 0, 16, 16)),
        TailRow("a blue square", 1.0, 6, g, seed=11),
    ]


def built_once(tmp_path_factory, key: str, build: Callable[[Path], object]) -> Path:
    """A folder that ``build`` fills, built once per test run: under pytest-xdist (`make test`)
    every worker shares it, the first to ask building it under a file lock while the others wait
    (pytest-xdist's advice for session fixtures); in one process, a fresh folder of this session.
    What is built is the same in every worker (seeded models, their exports), and no test writes
    into it (a test that needs a changed one copies it first)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # every worker of one run has the same
    if not run:
        folder = tmp_path_factory.mktemp(key)
        build(folder)
        return folder
    import shutil

    from filelock import FileLock

    # beside the workers' own folders, named by the run: never another run's build
    folder = tmp_path_factory.getbasetemp().parent / f"built-once-{run}" / key
    folder.parent.mkdir(exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


@pytest.fixture
def gpu(monkeypatch):
    """The simulated GPU (tests/fakegpu.py) in place of cuda-python, tensorrt and onnxruntime's CUDA provider."""
    from types import SimpleNamespace

    from edit_rt.runtime.engine import backend, backend_ort, cuda, graph_set

    from . import fakegpu

    cudart = fakegpu.FakeCudart()
    trt = fakegpu.FakeTensorRT(cudart)
    ort = fakegpu.FakeOrt(cudart)
    cuda.use_cudart(cudart)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(backend, "ort", ort)
    monkeypatch.setattr(backend_ort, "ort", ort)
    monkeypatch.setattr(graph_set, "gpu_name", lambda: "Simulated GPU")
    yield SimpleNamespace(cudart=cudart, trt=trt, ort=ort)
    cuda.use_cudart(None)


def _exported(model: Path, tmp_path_factory, build: str, name: str, **settings) -> Path:
    """``model`` exported with ``settings`` as ``<a build folder>/<name>/onnx`` (the layout
    `make export` gives, so a config's build_dir is the folder two levels up). The graphs are
    exported once per run; the build folder is this worker's own (under pytest-xdist its ``onnx``
    links to the shared graphs), so what tests write beside them (converted adapters, engines,
    stored bases) is never another worker's."""
    from edit_rt.export.compile.onnx_export import export_onnx

    graphs = built_once(tmp_path_factory, f"{build}-{name}", lambda folder: export_onnx(model, folder / "onnx", **settings))
    out = tmp_path_factory.mktemp(build) / name / "onnx"
    out.parent.mkdir(parents=True)
    out.symlink_to(graphs / "onnx", target_is_directory=True)
    return out


@pytest.fixture(scope="session", autouse=True)
def torch_one_thread():
    """PyTorch (the references, the exports) on one thread. Its OpenMP pool of two threads
    shares two cores with ONNX Runtime's and OpenVINO's spinning pools in the same process; on
    the tiny models a diffusers generation measured 0.4 s on one thread against 1.5-3.5 s on
    two beside an ONNX Runtime pipeline."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def onnxruntime_one_thread_per_worker():
    """Under pytest-xdist (`make test`: one worker per core), ONNX Runtime sessions in a worker
    take one intra-op thread where their config names none: its default pool is one spinning
    thread per core in every worker, so two workers on two cores would run four. A config that
    names `threads` keeps them; subprocesses (servers, the CLI) keep ONNX Runtime's default."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import onnxruntime as ort

    default = ort.SessionOptions

    class OneThread(default):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.intra_op_num_threads = 1

    ort.SessionOptions = OneThread
    yield
    ort.SessionOptions = default


@pytest.fixture(scope="session")
def diffusers_reference():
    """diffusers' generation per (model, sampler, base, initial latents), each computed once per
    session (tests/diffusers_reference.py)."""
    from .diffusers_reference import DiffusersReference

    return DiffusersReference()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from edit_rt.export.world.tiny_model import write_tiny_model

    return built_once(tmp_path_factory, "model-tiny-sd", lambda folder: write_tiny_model(folder / "tiny-sd", seed=0)) / "tiny-sd"


@pytest.fixture(scope="session")
def onnx_dir(model_dir, tmp_path_factory) -> Path:
    return _exported(model_dir, tmp_path_factory, "build", "tiny-sd")


@pytest.fixture(scope="session")
def adapter_onnx_dir(model_dir, tmp_path_factory) -> Path:
    """The tiny model exported with 3 LoRA slots of rank 8, as ``<build>/tiny-sd/onnx`` (its
    converted adapters go to ``<build>/tiny-sd/adapters``, as `make export` lays them out)."""
    return _exported(model_dir, tmp_path_factory, "build-adapters", "tiny-sd", adapter_slots_n=3, adapter_rank=8)


@pytest.fixture(scope="session")
def sdxl_dir(tmp_path_factory) -> Path:
    """A tiny random SDXL (two text encoders, ``text_time`` conditioning, SDXL's Euler config)."""
    from edit_rt.export.world.tiny_model import write_tiny_sdxl

    return built_once(tmp_path_factory, "model-tiny-sdxl", lambda folder: write_tiny_sdxl(folder / "tiny-sdxl", seed=0)) / "tiny-sdxl"


@pytest.fixture(scope="session")
def sdxl_onnx_dir(sdxl_dir, tmp_path_factory) -> Path:
    return _exported(sdxl_dir, tmp_path_factory, "build", "tiny-sdxl")


@pytest.fixture(scope="session")
def sd2_dir(tmp_path_factory) -> Path:
    """A tiny random SD 2.x: v-prediction, upcast_attention, linear projections, GELU text encoder."""
    from edit_rt.export.world.tiny_model import write_tiny_model

    return built_once(tmp_path_factory, "model-tiny-sd2",
                      lambda folder: write_tiny_model(folder / "tiny-sd2", seed=1, preset="tiny-sd2")) / "tiny-sd2"


@pytest.fixture(scope="session")
def sd2_onnx_dir(sd2_dir, tmp_path_factory) -> Path:
    return _exported(sd2_dir, tmp_path_factory, "build", "tiny-sd2")


@pytest.fixture(scope="session")
def taesd_dir(model_dir, tmp_path_factory) -> Path:
    """The tiny model with a random tiny autoencoder (TAESD's architecture, 16 channels, the
    VAE's 2x) in its ``vae_tiny/``."""
    import shutil

    from edit_rt.export.world.tiny_model import write_tiny_vae

    def build(folder: Path) -> None:
        shutil.copytree(model_dir, folder / "tiny-taesd")
        write_tiny_vae(folder / "tiny-taesd" / "vae_tiny", seed=1, factor=2, channels=16)

    return built_once(tmp_path_factory, "model-tiny-taesd", build) / "tiny-taesd"


@pytest.fixture(scope="session")
def taesd_onnx_dir(taesd_dir, tmp_path_factory) -> Path:
    return _exported(taesd_dir, tmp_path_factory, "build", "tiny-taesd")


@pytest.fixture(scope="session")
def pipeline(onnx_dir, model_dir):
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    with EditPipeline(onnx_dir, model_dir) as pipe:
        yield pipe


@pytest.fixture(scope="session")
def base_state(pipeline):
    return pipeline.generate_base(TEST_BASE)


@pytest.fixture(scope="module")
def diffusers_pipe(model_dir):
    """diffusers' own StableDiffusionPipeline on the tiny model, with DDIMScheduler (eta 0)."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(model_dir)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def torch_components(model_dir):
    """Fresh (unet, text_encoder, vae, tokenizer, scheduler_config) from diffusers/transformers.

    Function-scoped: wrapping the UNet for export swaps its attention processors.
    """
    from edit_rt.export.compile.onnx_export import load_components

    return load_components(model_dir)


SHAPES_MODEL = Path(__file__).resolve().parents[1] / "export" / "models" / "shapes-sd"


@pytest.fixture(scope="session")
def shapes_onnx_dir(tmp_path_factory) -> Path:
    """The committed shapes model, exported once per session (build/<model>/onnx layout)."""
    from edit_rt.export.compile.onnx_export import export_onnx

    return built_once(tmp_path_factory, "build-shapes-sd",
                      lambda folder: export_onnx(SHAPES_MODEL, folder / "shapes-sd" / "onnx")) / "shapes-sd" / "onnx"


# The longest test files, measured (the seconds each took on its worker under `make test`, its
# fixtures included), run first: under pytest-xdist each file runs whole on one worker, handed
# out in collection order (`--no-loadscope-reorder`: xdist's own order is by the number of tests
# a file has), so a long file collected last would run alone at the end while the other idles.
LONGEST_FIRST = ("test_gpu_rules.py", "test_ray.py", "test_openvino.py", "test_families.py", "test_bench.py",
                 "test_engines.py", "test_sliders_world.py", "test_memory.py", "test_python_api.py",
                 "test_openai_door.py", "test_pins.py", "test_a1111.py", "test_demo_sweeps.py", "test_page_sliders.py",
                 "test_server.py", "test_job_scope.py", "test_web_security.py", "test_lora_tags.py")  # fmt: skip


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: every file's own order kept
