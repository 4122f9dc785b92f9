"""The Python API: :class:`Editor`, the operations of `edit-rt serve` in a script, no web server.

    from edit_rt.runtime.apps.editor import Editor

    with Editor.from_config("configs/demo.yaml") as ed:
        base = ed.generate()                        # the config's base
        edits = ed.edit(base, ["a green circle on a blue background, top left",
                               {"prompt": "a red square on a blue background, top left", "strength": 0.5}])
        edits[0].save("green.png")

An Editor is a loaded :class:`~edit_rt.runtime.serving.service.Service`, the object behind every
route of the server: its ``generate``, ``edit`` and ``invert`` are the service's own operations,
so a script gets what a client of the server gets: the config's defaults, the store (bases kept
by key in RAM and on disk, found again by id), the same refusals (with the field they name) and,
byte for byte, the PNGs the server sends, each with its AUTOMATIC1111 ``parameters``. The
service's operations are coroutines; the Editor runs them on an event loop of its own, in a
thread, so it works the same in a script and in a notebook (whose own loop is already running),
and calls from several threads batch together in the one step loop. See docs/python.md.
"""

from __future__ import annotations

import asyncio
import io
import logging
import threading
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterator, Optional, Sequence, TypeVar, Union

import numpy as np
from PIL import Image
from pydantic import TypeAdapter, ValidationError

from ..config.load import config_from_dict, load_config
from ..config.plan import PlanScene, PlanSection
from ..config.run_config import RunConfig
from ..errors import EditRtError, EditorError
from ..model import driving
from ..model.edit import Base, Direction, Edit
from ..model.schema import request_refusal
from ..model.sweep import expand
from ..pipeline.images import to_uint8
from ..pipeline.pnginfo import parse_fields
from ..pipeline.plans import PlanOutcome, Variant
from ..serving import service as service_module
from ..serving.service import Service
from .run import edit_label


T = TypeVar("T")
EditSpec = Union[Edit, dict, str]  # an Edit, its fields as a mapping (a config's edit, + pixel_mask), or a prompt
ImageInput = Union[str, Path, bytes, Image.Image, np.ndarray]
Progress = Callable[[int, int, int], None]  # (edit index, steps done, steps of its tail)
# (index, step, of, the decoded prediction of the final image at that step: DDIM's x_0 estimate)
Preview = Callable[[int, int, int, Image.Image], None]


class _FromConfig:
    def __repr__(self) -> str:
        return "FROM_CONFIG"


# An argument left at this takes the config's ``base:`` value (where None means something else:
# a negative prompt of None is the model family's default, as in the config and the API).
FROM_CONFIG: Any = _FromConfig()


@dataclass(frozen=True)
class Result:
    """An image edit-rt made: its PNG as the server sends it, and the base it belongs to."""

    png: bytes  # with its ``parameters`` text chunk (AUTOMATIC1111's format)
    base_id: str  # the base this image is (generate, invert) or was edited from (edit)
    seconds: float

    @cached_property
    def parameters(self) -> str:
        """The PNG's ``parameters`` text: prompt, ``Negative prompt: ...``, then ``Key: value, ...``."""
        return _parameters(self.png)

    @cached_property
    def fields(self) -> dict[str, str]:
        """The parameters' last line as a mapping (``{"Steps": "30", "Seed": "2", ...}``)."""
        return _fields(self.png)

    @property
    def image(self) -> Image.Image:
        """The PNG decoded (a new RGB PIL image on each access)."""
        return _decoded(self.png)

    @property
    def array(self) -> np.ndarray:
        """The PNG's pixels, uint8 [H, W, 3]."""
        return np.asarray(self.image)

    def save(self, path: Union[str, Path]) -> Path:
        """Write the PNG (its parameters included) to ``path``."""
        path = Path(path)
        path.write_bytes(self.png)
        return path


@dataclass(frozen=True)
class BaseResult(Result):
    """A base: generated or inverted, and kept in the store under ``base_id``."""

    seed: int  # of its initial noise (the one drawn, when generate was given seed=-1)
    prompt: str
    negative_prompt: Optional[str]
    tier: Optional[str]  # the store tier that holds it ("ram", "disk")


@dataclass(frozen=True)
class EditResult(Result):
    """One edit of a base, as it ran (its defaults filled in)."""

    index: int  # its place in the edits given
    label: str  # the edit's label, or a summary of its fields (as `edit-rt run` labels its grid)
    strength: float
    tail_steps: int
    preserve: str  # what its preserve mode came to ("auto", "none", or why none)
    uncond: str = "compute"  # where its unconditional prediction came from (tail.uncond, as it ran)


_EDIT = TypeAdapter(Edit)
_BASE = TypeAdapter(Base)
_SCENE = TypeAdapter(PlanScene)
_PLAN = TypeAdapter(PlanSection)


class Editor:
    """A config's engines, store and step loop, and the operations every door of edit-rt uses.

    Use as a context manager (``with Editor.from_config(path) as ed:``), or call :meth:`close`:
    it releases the engines and the step loop's memory."""

    def __init__(self, cfg: RunConfig):
        """Load ``cfg``'s engines and open its store: seconds. The artifacts must exist (`edit-rt
        export CONFIG`; for TensorRT also `edit-rt engines CONFIG`); a missing or stale one is
        the CLI's one-line error (an :class:`~edit_rt.runtime.errors.EditRtError`)."""
        self.config = cfg
        self.service = Service(cfg)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="edit-rt-editor", daemon=True)
        self._closed = False
        with _raised_not_logged(service_module.log):
            self.service.load()
        if self.service.load_error is not None:
            self.service.shutdown()
            self._loop.close()
            raise EditRtError(self.service.load_error)
        self._thread.start()

    @classmethod
    def from_config(cls, path: Union[str, Path]) -> "Editor":
        """An Editor for a run config (YAML; the same file `edit-rt run` and `edit-rt serve` take)."""
        return cls(load_config(Path(path)))

    @classmethod
    def from_model(cls, model: Union[str, Path], build_dir: Union[str, Path] = "build", *, width: int = 512,
                   height: int = 512, steps: int = 50, guidance: float = 7.5, **sections: Any) -> "Editor":  # fmt: skip
        """An Editor for a diffusers model folder exported under ``build_dir`` (`edit-rt export`
        with a config naming this model and build_dir). ``sections`` are further config keys
        (``store={"disk_dir": "bases"}``, ``cache={...}``, ``backend="auto"``), validated as a
        config's: an unknown or out-of-range one is refused naming it. Relative paths are taken
        from the current folder."""
        if "plan" in sections:  # a planner: its base sets seed, steps and guidance only (config/plan.py)
            base = sections.pop("base", {})
        else:
            base = {"prompt": "", "width": width, "height": height, "steps": steps, "guidance": guidance,
                    **sections.pop("base", {})}  # fmt: skip
        return cls(config_from_dict({"model": str(model), "build_dir": str(build_dir), "base": base, **sections}))

    # --- life -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the step loop and release the engines (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        self.service.shutdown()
        asyncio.run_coroutine_threadsafe(self._loop.shutdown_default_executor(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "Editor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- operations -----------------------------------------------------------------------------

    def generate(self, prompt: Optional[str] = None, *, negative_prompt: Optional[str] = FROM_CONFIG,
                 seed: Optional[int] = None, steps: Optional[int] = None, guidance: Optional[float] = None,
                 clip_skip: Optional[int] = None, size: Optional[str] = None, original_width: Optional[int] = None,
                 original_height: Optional[int] = None, crop_top: Optional[int] = None, crop_left: Optional[int] = None,
                 previews: int = 0, on_preview: Optional[Preview] = None, sampler: Optional[str] = None) -> BaseResult:  # fmt: skip
        """Generate a base and keep it in the store. An argument left out is the config's
        ``base:`` value; ``seed=-1`` draws a random seed (as AUTOMATIC1111's API; the result says
        which); ``size`` ("WxH") is one the config serves (``base.width`` x ``base.height``, the
        default, or one of ``engines.sizes``); ``original_width``, ``original_height``,
        ``crop_top``, ``crop_left``: SDXL's size conditioning (refused on other models);
        ``sampler``: "dpmpp_2m_karras", or A1111's "DPM++ 2M Karras" (its edits run it too).
        ``previews``: that many ``on_preview`` calls spread over the steps. The same settings again generate the same base, under the same id."""
        _check_previews(previews, on_preview)
        if size is not None and not isinstance(size, str):
            raise EditorError(f"size: a string \"WxH\" (\"512x512\"), got {type(size).__name__}", "size", "invalid_type")
        b = self.config.base
        given = {"prompt": b.prompt if prompt is None else prompt,
                 "negative_prompt": b.negative_prompt if negative_prompt is FROM_CONFIG else negative_prompt,
                 "seed": b.seed if seed is None else seed, "steps": steps, "guidance": guidance, "clip_skip": clip_skip}  # fmt: skip
        sizes = {"original_width": original_width, "original_height": original_height, "crop_top": crop_top,
                 "crop_left": crop_left}  # fmt: skip
        checked = {k: v for k, v in {**given, **sizes}.items() if v is not None and not (k == "seed" and v == -1)}
        _validated(_BASE, Base, checked, "")

        async def generate():
            s = self.service
            base = s.fields.base_of(given["prompt"], given["negative_prompt"], size, steps, guidance, given["seed"], clip_skip,
                             sizes, sampler=sampler)  # fmt: skip
            async with aclosing(s.generate_events(base, previews)) as events:
                async for kind, data in events:
                    if kind == "edit_rt.preview":
                        on_preview(data["index"], data["step"], data["of"], _decoded(data["png"]))
                    elif kind == "generated":
                        return data

        g = self._run(generate())
        return BaseResult(g.png, g.id, g.seconds, g.base.seed, g.base.prompt, g.base.negative_prompt, g.tier)

    def invert(self, image: ImageInput, source_prompt: str = "", *, negative_prompt: Optional[str] = FROM_CONFIG,
               steps: Optional[int] = None, guidance: Optional[float] = None,
               clip_skip: Optional[int] = None) -> BaseResult:  # fmt: skip
        """A base from an image (a path, PNG/JPEG/WebP bytes, a PIL image, or a uint8 or [0, 1]
        float array [H, W, 3]): inverted (Direct Inversion), kept in the store, and returned
        as the image its base decodes to. ``source_prompt`` says what it shows. The image is
        read as the server reads an upload (``serve.max_image_bytes``, ``max_image_pixels``,
        resized to the served size when ``serve.resize_uploads``); the same image with the
        same settings finds its stored base instead of inverting again."""
        data = _image_bytes(image)
        b = self.config.base
        negative = b.negative_prompt if negative_prompt is FROM_CONFIG else negative_prompt
        given = {"prompt": source_prompt, "negative_prompt": negative, "steps": steps, "guidance": guidance,
                 "clip_skip": clip_skip}  # fmt: skip
        _validated(_BASE, Base, {k: v for k, v in given.items() if v is not None}, "")

        async def invert():
            upload = await self.service.images.upload(data, "image")
            return await self.service.invert(upload, source_prompt, negative, steps, guidance, clip_skip)

        g = self._run(invert())
        return BaseResult(g.png, g.id, g.seconds, g.base.seed, g.base.prompt, g.base.negative_prompt, g.tier)

    def edit(self, base: Union[BaseResult, str], edits: Sequence[EditSpec], *, on_progress: Optional[Progress] = None,
             previews: int = 0, on_preview: Optional[Preview] = None) -> list[EditResult]:  # fmt: skip
        """Every edit of the stored ``base`` (a result or its id) as one batched tail, in order.

        An edit is an :class:`~edit_rt.runtime.model.edit.Edit`, a mapping of its fields (as a
        config's ``edits:`` entry: prompt, strength, directions, start_step or tail_steps or
        tail_fraction, guidance, mask, seed, preserve, structure, uncond, deepcache, label; and, in a mapping only,
        ``pixel_mask``: an [H, W] array in [0, 1] at the base's size, 1 where the image may
        change, 0 where it keeps the base's pixel exactly), or a prompt; what it leaves out is
        the config's default (``cache.default_strength``, ``default_tail_fraction``,
        ``preserve.mode``, ``preserve.structure``, ``tail.uncond``, ``tail.deepcache``).

        ``on_progress(index, step, of)`` is called as each edit's tail advances, and
        ``on_preview(index, step, of, image)`` ``previews`` times per edit over its tail (both
        on the Editor's thread: keep them short, and call no Editor method from them). Any
        refused edit refuses the call before anything runs."""
        _check_previews(previews, on_preview)
        bid = base if isinstance(base, str) else base.base_id
        specs, pixel_masks = [], []
        for i, given in enumerate(edits):
            spec, pixel_mask = _edit_of(given, i)
            try:  # a sweep is its rows, in place, as at every door (model/sweep.py)
                rows = expand(spec)
            except ValueError as err:
                raise EditorError(f"edits[{i}].{err}", f"edits[{i}].sweep", "out_of_range") from None
            specs += rows
            pixel_masks += [pixel_mask] * len(rows)

        async def edit():
            out = []
            events = self.service.edit_events(bid, specs, "base_id", previews, pixel_masks=pixel_masks)
            async with aclosing(events):
                async for kind, data in events:
                    if kind == "edit_rt.progress" and on_progress is not None:
                        on_progress(data["index"], data["step"], data["of"])
                    elif kind == "edit_rt.preview":
                        on_preview(data["index"], data["step"], data["of"], _decoded(data["png"]))
                    elif kind == "error":
                        raise data["error"]
                    elif kind == "image_edit.completed":
                        out.append(self._edit_result(bid, specs, data))
            return sorted(out, key=lambda r: r.index)

        return self._run(edit())

    def info(self, base: Union[BaseResult, str]) -> dict:
        """What the store knows of a base (its tier, bytes, prompt, steps, ...)."""
        return self._run(self.service.base_info(base if isinstance(base, str) else base.base_id))

    def delete(self, base: Union[BaseResult, str]) -> None:
        """Drop a base from the store (RAM and disk, for every process sharing the folder)."""
        self._run(self.service.delete_base(base if isinstance(base, str) else base.base_id))

    def __contains__(self, base: Union[BaseResult, str]) -> bool:
        return self._run(self.service.has_base(base if isinstance(base, str) else base.base_id))

    def plan(self, scene: Union[dict, driving.Scene], behaviours: Sequence[str] = driving.BEHAVIOURS,
             aggressiveness: Sequence[float] = (0.0, 0.5, 1.0), *, base_behaviour: str = "keep lane",
             base_aggressiveness: float = 0.5, tail_steps: Optional[int] = None,
             seed: Optional[int] = None) -> PlanOutcome:  # fmt: skip
        """A planner's loop (an Editor of a plan config): the scene's base plan (kept from an
        earlier call, or generated) and every behaviour x aggressiveness as one batched tail of
        it, each judged; the outcome holds every trajectory and score, the best, and
        ``picture()``. ``scene``: a driving.Scene, or its fields as a dict (checked as POST
        /v1/plans checks them)."""
        if not isinstance(scene, driving.Scene):
            scene = _validated(_SCENE, PlanScene, scene if isinstance(scene, dict) else {}, "scene.").to_scene("scene")
        asked = {"behaviours": list(behaviours), "aggressiveness": list(aggressiveness), "base_behaviour": base_behaviour,
                 "base_aggressiveness": base_aggressiveness}  # fmt: skip
        v = _validated(_PLAN, PlanSection, asked, "")
        variants = [Variant(b, a) for b in v.behaviours for a in v.aggressiveness]
        return self._run(self.service.plan(scene, variants, Variant(v.base_behaviour, v.base_aggressiveness), tail_steps, seed))

    # --- the loop -------------------------------------------------------------------------------

    def _edit_result(self, bid: str, specs: list[Edit], data: dict) -> EditResult:
        info, png, i = data["info"], data["png"], data["index"]
        steps = int(_fields(png)["Steps"])  # what ran: the base's steps, from the PNG's own parameters
        directions = [Direction(**d) for d in info.get("directions", ())]
        label = edit_label(specs[i], info["strength"], steps - info["tail_steps"], steps, info["preserve"], directions)
        return EditResult(png, bid, info["seconds"], i, label, info["strength"], info["tail_steps"], info["preserve"],
                          info.get("uncond", "compute"))  # fmt: skip

    def _run(self, operation: Coroutine[Any, Any, T]) -> T:
        """Run one of the service's operations on the Editor's loop and wait for it; its refusal
        (a domain error, with its field and code) becomes an :class:`EditorError` caused by it.
        Interrupted (Ctrl-C), its rows leave the batch at the next step."""
        if self._closed:
            operation.close()
            raise EditRtError("this Editor is closed (its engines were released); open another one")
        if threading.current_thread() is self._thread:
            operation.close()
            raise EditRtError("an Editor method was called from an on_progress or on_preview callback, which runs "
                              "on the Editor's own thread and would wait for itself; call it after the call returns")  # fmt: skip
        future = asyncio.run_coroutine_threadsafe(operation, self._loop)
        try:
            return future.result()
        except EditorError:
            raise
        except EditRtError as err:
            raise EditorError(str(err), err.field, err.code) from err
        except BaseException:
            future.cancel()
            raise


def _check_previews(previews: int, on_preview: Optional[Preview]) -> None:
    if not isinstance(previews, int) or isinstance(previews, bool) or not 0 <= previews <= 1000:
        raise EditorError(f"previews: must be an integer in [0, 1000], got {previews!r}", "previews", "out_of_range")
    if previews and on_preview is None:
        raise EditorError("previews: asked for without on_preview; pass on_preview=callback(index, step, of, image)",
                          "previews", "missing_callback")  # fmt: skip
    if on_preview is not None and not previews:
        raise EditorError("on_preview: given with previews=0; ask for previews=k (k previews per image)", "on_preview",
                          "missing_previews")  # fmt: skip


def _decoded(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png)).convert("RGB")


def _parameters(png: bytes) -> str:
    return Image.open(io.BytesIO(png)).text["parameters"]


def _fields(png: bytes) -> dict[str, str]:
    return parse_fields(_parameters(png).split("\n")[-1])


def _validated(adapter: TypeAdapter, owner: type, data: dict, where: str) -> Any:
    """``data`` validated as the config and the API validate it (the types and ranges of
    ``owner``'s fields), or the EditorError naming the field."""
    try:
        return adapter.validate_python(data)
    except ValidationError as err:
        refused = request_refusal(err.errors(), owner=owner)
        more = " (or -1 for a random seed)" if refused.field == "seed" else ""
        raise EditorError(where + str(refused) + more, where + (refused.field or ""), refused.code) from None


def _edit_of(spec: EditSpec, i: int) -> tuple[Edit, Optional[np.ndarray]]:
    """Edit ``i`` as given, validated, and its pixel mask (checked by the service against the base)."""
    if isinstance(spec, Edit):
        return spec, None
    if isinstance(spec, str):
        spec = {"prompt": spec}
    if not isinstance(spec, dict):
        raise EditorError(f"edits[{i}]: an Edit, a mapping of its fields or a prompt string, got {type(spec).__name__}",
                          f"edits[{i}]", "invalid_type")  # fmt: skip
    fields = {k: v for k, v in spec.items() if k != "pixel_mask"}
    return _validated(_EDIT, Edit, fields, f"edits[{i}]."), spec.get("pixel_mask")


def _image_bytes(image: ImageInput) -> bytes:
    """An image argument as the bytes of an upload (a PNG for arrays and PIL images: lossless)."""
    if isinstance(image, bytes):
        return image
    if isinstance(image, (str, Path)):
        try:
            return Path(image).read_bytes()
        except OSError as err:
            raise EditorError(f"image: {image} cannot be read ({err.strerror})", "image", "invalid_image") from None
    if isinstance(image, np.ndarray):
        if image.dtype.kind == "f":
            if not np.isfinite(image).all() or image.min() < 0.0 or image.max() > 1.0:
                raise EditorError("image: a float array must hold values in [0, 1]; scale it, or pass uint8",
                                  "image", "invalid_image")  # fmt: skip
            image = to_uint8(image)
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise EditorError(f"image: an array must be uint8 or float [H, W] or [H, W, 3], got {image.dtype} "
                              f"{list(image.shape)}", "image", "invalid_image")  # fmt: skip
        image = Image.fromarray(image)
    if isinstance(image, Image.Image):
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()
    raise EditorError(f"image: a path, bytes, a PIL image or a numpy array, got {type(image).__name__}", "image",
                      "invalid_image")  # fmt: skip


@contextmanager
def _raised_not_logged(logger: logging.Logger) -> Iterator[None]:
    """While the service loads: its log record of a failure that is the user's to fix (an
    EditRtError: a missing export, a bad size) is dropped, because the Editor raises it as the
    one line it is. Any other failure (a bug) keeps its logged traceback."""

    def keep(record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], EditRtError))

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
