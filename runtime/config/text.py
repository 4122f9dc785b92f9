"""A text config (issue 56): a text model (a masked-diffusion one or its autoregressive baseline),
where its export goes, and what `edit-rt run` writes with it: N continuations of one prompt as one
batch, then span edits of the first continuation, each as one batch.

A text config is its own kind (``text:`` at its top level): it has no ``base:`` or ``edits:`` of
pictures, and only the keys below; ``load.py`` reads it into :class:`TextRunConfig`.

    model: ../export/models/text-mdm
    build_dir: ../build
    output_dir: ../out/text
    text:
      prompt: "def mean(values):\\n"
      max_tokens: 64
      rows: [{seed: 0}, {seed: 1, temperature: 0.8}, {instruction: "# recursive"}]
      threshold: 0.9
      cache: prefix
      edits: [{lines: [1, 2]}]
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from ..errors import ConfigError
from ..model.schema import Float, Int, Str, between
from .serve import Serve

STRICT = ConfigDict(extra="forbid")
Backend = Literal["auto", "ort-cpu", "openvino", "trt"]


@pydantic_dataclass(frozen=True, config=STRICT)
class TextRow:
    """One continuation: its seed, its temperature (None: the section's), and an instruction line
    put before the prompt (a comment such as ``# in one line``), None: the prompt as it is."""

    seed: between(Int, 0) = 0
    temperature: Optional[between(Float, 0.0, 10.0)] = None
    instruction: Optional[Str] = None


@pydantic_dataclass(frozen=True, config=STRICT)
class TextEdit:
    """A span edit of the first continuation: the span re-masked and decoded again, every token
    outside it kept. ``tokens: [a, b]`` the continuation's tokens a..b-1; ``lines: [a, b]`` its lines
    a..b-1 (0 the first), whole tokens."""

    tokens: Optional[Annotated[list[between(Int, 0)], Field(min_length=2, max_length=2)]] = None
    lines: Optional[Annotated[list[between(Int, 0)], Field(min_length=2, max_length=2)]] = None
    seed: between(Int, 0) = 0
    temperature: between(Float, 0.0, 10.0) = 0.0

    def check(self, where: str) -> "TextEdit":
        if (self.tokens is None) == (self.lines is None):
            raise ConfigError(f"{where}: give tokens: [start, end] or lines: [start, end], one of them")
        a, b = self.tokens if self.tokens is not None else self.lines
        if b <= a:
            raise ConfigError(f"{where}.{'tokens' if self.tokens is not None else 'lines'}: [{a}, {b}] is empty; end must be past start")
        return self


@pydantic_dataclass(frozen=True, config=STRICT)
class TextStyle:
    """A style pass over every finished continuation (pipeline/text_pipeline.py ``style_pass``):
    each token read again masked, replaced where the model now predicts another with probability
    >= ``edit_threshold``, up to ``rounds`` rounds."""

    edit_threshold: between(Float, 0.0, 1.0) = 0.9
    rounds: between(Int, 1, 64) = 2
    groups: between(Int, 1, 64) = 4  # masked copies of a text a round (one batch): a token is read masked in one
    cache: Literal["none", "prefix"] = "prefix"
    instruction: Optional[Str] = None  # a line put before the text while the pass runs


@pydantic_dataclass(frozen=True, config=STRICT)
class TextSection:
    prompt: Str
    max_tokens: between(Int, 1, 4096) = 64
    rows: Annotated[list[TextRow], Field(min_length=1)] = dataclasses.field(default_factory=lambda: [TextRow()])
    temperature: between(Float, 0.0, 10.0) = 0.0
    stop: list[Str] = dataclasses.field(default_factory=list)
    # masked diffusion's decoding (runtime/loop/text_decoding.py); an autoregressive model reads
    # only the temperatures. threshold (parallel decoding) or steps (LLaDA's fixed schedule).
    block_length: between(Int, 1, 4096) = 32
    threshold: Optional[between(Float, 0.0, 1.0)] = 0.9
    steps: Optional[between(Int, 1, 4096)] = None
    edit_threshold: Optional[between(Float, 0.0, 1.0)] = None
    edit_rounds: between(Int, 0, 16) = 1
    cache: Literal["none", "prefix", "dual"] = "prefix"
    edits: list[TextEdit] = dataclasses.field(default_factory=list)
    style: Optional[TextStyle] = None


@pydantic_dataclass(frozen=True, config=STRICT)
class TextEnginesSection:
    """`edit-rt engines` of a text config: TensorRT plans of its graphs (export/compile/text_engines.py)."""

    max_rows: between(Int, 1, 1024) = 16  # rows one call takes; more run in pieces of this many
    precision: Literal["fp32"] = "fp32"


@pydantic_dataclass(frozen=True, config=STRICT)
class TextRunConfig:
    model: Path  # a text model folder (export/compile/text_model.py's save_text_model)
    text: TextSection
    build_dir: Path = Path("build")
    output_dir: Path = Path("out/text")
    backend: Backend = "auto"
    threads: between(Int, 0, 256) = 0
    engines: TextEnginesSection = dataclasses.field(default_factory=TextEnginesSection)
    # `edit-rt serve` of a text config (OpenAI's /v1/completions, web/api_completions.py): the
    # image server's section, its limits read as a text server's (serving/text_service.py)
    serve: Serve = dataclasses.field(default_factory=Serve)
    source: Optional[Path] = None  # the file it was read from (set at load)

    @property
    def onnx_dir(self) -> Path:
        return self.build_dir / self.model.name / "onnx"

    @property
    def engines_dir(self) -> Path:
        return self.build_dir / self.model.name / "engines"

    @property
    def engine(self) -> str:
        """The backend that runs: ``auto`` is ``trt`` where its plans are built and TensorRT can
        start, else ``ort-cpu``."""
        if self.backend != "auto":
            return self.backend
        if (self.engines_dir / "trt" / "text_engines.json").is_file():
            from ..engine.backend_trt import trt_unavailable_reason

            if trt_unavailable_reason() is None:
                return "trt"
        return "ort-cpu"

    def validate(self) -> "TextRunConfig":
        t = self.text
        if (t.threshold is None) == (t.steps is None):
            raise ConfigError("text.threshold / text.steps: give one of them (threshold: parallel decoding; steps: "
                              "a fixed schedule); set the other to null")  # fmt: skip
        for k, edit in enumerate(t.edits):
            edit.check(f"text.edits[{k}]")
        return self
