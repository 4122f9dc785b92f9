"""An exported text model on a runtime engine (issue 56): its two graphs, its tokenizer, and the
operations every door uses (a completion, N continuations of one prefix, a span edit, a style
pass), each one batched call of the decoding loop (loop/text_decoding.py).

The graphs run on the same backends as the UNet's (engine/): ``ort-cpu`` (ONNX Runtime),
``openvino`` (its CPU plugin, compiled once with dynamic shapes: a decoding step's shapes change
every step), or any other ONNX Runtime provider. A masked-diffusion model decodes in blocks with
the loop's cache modes; an autoregressive one with its K/V cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import ConfigError, RequestError
from ..loop.text_decoding import CACHE_MODES, DecodeStats, decode_autoregressive, decode_masked, restyle
from ..model.text_manifest import TextManifest


def text_graph(path: Path, backend: str, threads: int, device=None):
    """One text graph on ``backend``, not yet activated (``trt``: ``path`` is its plan, ``device``
    the one :class:`~edit_rt.runtime.engine.backend_trt.TrtDevice` both graphs share)."""
    if backend == "openvino":
        from ..engine.backend_ov import OvGraph

        return OvGraph(path, threads=threads, static=False)
    if backend == "trt":
        from ..engine.backend_trt import TrtGraph

        return TrtGraph(path, device, cuda_graphs=False)  # every step's shapes differ: infer(), no capture
    from ..engine.backend_ort import OrtGraph

    return OrtGraph(path, backend, threads=threads)


def text_engines(onnx_dir: Path, engines_dir: Optional[Path]):
    """The TensorRT plans of the text graphs in ``engines_dir/trt``, checked against the export
    and this machine (a missing, stale or foreign folder is refused, naming the command)."""
    from ..engine.backend_trt import trt_unavailable_reason
    from ..engine.graph_set import engine_device, engine_tools
    from ..model.text_manifest import TextEngines

    reason = trt_unavailable_reason()
    if reason is not None:
        raise ConfigError(f"backend: trt cannot start here ({reason}); use ort-cpu or openvino")
    if engines_dir is None:
        raise ConfigError("backend: trt needs the text model's TensorRT plans; run `edit-rt engines CONFIG`")
    return TextEngines.load(Path(engines_dir) / "trt", onnx_dir, engine_device("trt"), engine_tools("trt"))


@dataclass(frozen=True)
class Decoding:
    """How a masked-diffusion model decodes (an autoregressive one reads only ``temperature``)."""

    block_length: int = 32
    threshold: Optional[float] = 0.9  # parallel decoding; None: ``steps``
    steps: Optional[int] = None  # LLaDA's fixed schedule over the whole generation
    edit_threshold: Optional[float] = None  # token-to-token editing; None: off
    edit_rounds: int = 1
    cache: str = "prefix"
    temperature: float = 0.0

    @classmethod
    def of(cls, section, **given) -> "Decoding":
        """A config's ``text:`` decoding (config/text.py), with the ``given`` fields that are not None over it."""
        fields = {"block_length": section.block_length, "threshold": section.threshold, "steps": section.steps,
                  "edit_threshold": section.edit_threshold, "edit_rounds": section.edit_rounds, "cache": section.cache,
                  "temperature": section.temperature}  # fmt: skip
        fields.update({k: v for k, v in given.items() if v is not None})
        if given.get("threshold") is not None:  # a request's threshold: parallel decoding, whatever the config's schedule
            fields["steps"] = None
        return cls(**fields).check()

    def check(self) -> "Decoding":
        if (self.threshold is None) == (self.steps is None):
            raise ConfigError("text.threshold / text.steps: give one of them (threshold: parallel decoding; steps: a fixed schedule)")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"text.threshold: {self.threshold:g} is outside [0, 1]")
        if self.edit_threshold is not None and not 0.0 < self.edit_threshold <= 1.0:
            raise ConfigError(f"text.edit_threshold: {self.edit_threshold:g} is outside (0, 1]")
        if self.cache not in CACHE_MODES:
            raise ConfigError(f"text.cache: {self.cache!r} is not one of {', '.join(CACHE_MODES)}")
        if self.block_length < 1:
            raise ConfigError(f"text.block_length: {self.block_length} must be at least 1")
        if self.temperature < 0:
            raise ConfigError(f"text.temperature: {self.temperature:g} must be >= 0")
        return self


@dataclass(frozen=True)
class Style:
    """A style pass (:meth:`TextPipeline.style_pass`, loop/text_decoding.py ``restyle``): every
    token of a finished continuation read again masked (``groups`` masked copies of the text a
    round, one batch), those the model now predicts otherwise with probability >=
    ``edit_threshold`` replaced, up to ``rounds`` rounds, under an optional ``instruction`` line."""

    edit_threshold: float = 0.9
    rounds: int = 2
    groups: int = 4
    cache: str = "prefix"
    instruction: Optional[str] = None


@dataclass(frozen=True)
class Row:
    """One continuation: its seed, its temperature (None: the decoding's), an instruction line
    put before the prompt (None: the prompt as it is)."""

    seed: int = 0
    temperature: Optional[float] = None
    instruction: Optional[str] = None


@dataclass
class TextResult:
    """Rows of one call: each row's ids (its whole text: prompt and continuation), where its
    continuation starts, its text there (up to its end or a stop string)."""

    ids: list  # each row's int64 [L_k]
    starts: list[int]  # each row's continuation's first position (its prompt's length)
    texts: list[str]
    finish_reasons: list[str]  # "stop": the end of text or a stop string; "length": max_tokens
    stats: DecodeStats
    seconds: float
    tokens: list[int] = field(default_factory=list)  # each row's continuation tokens up to its end


class TextPipeline:
    """An exported text model (``text_manifest.json``) ready to decode; a context manager."""

    def __init__(self, folder: Path, backend: str = "ort-cpu", threads: int = 0, engines_dir: Optional[Path] = None):
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        self.manifest = TextManifest.load(self.folder)
        self.tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        self.backend = backend
        self.max_rows: Optional[int] = None  # rows one call may take (a TensorRT profile's); None: any
        self.device = None
        if backend == "trt":
            from ..engine.backend_trt import TrtDevice

            engines = text_engines(self.folder, engines_dir)
            self.max_rows, self.device = engines.max_rows, TrtDevice()
            self.graphs = {name: text_graph(engines.path(name), backend, threads, self.device) for name in self.manifest.graphs}
        else:
            self.graphs = {name: text_graph(self.folder / f"{name}.onnx", backend, threads) for name in self.manifest.graphs}

    @classmethod
    def from_config(cls, cfg) -> "TextPipeline":
        """A text config's (config/text.py) export on its backend."""
        return cls(cfg.onnx_dir, cfg.engine, cfg.threads, cfg.engines_dir)

    def __enter__(self) -> "TextPipeline":
        for graph in self.graphs.values():
            graph.activate()
        return self

    def __exit__(self, *exc) -> None:
        for graph in self.graphs.values():
            graph.deactivate()
        if self.device is not None:
            self.device.free()

    # the loop's TextGraphs
    def full(self, ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, kv = self.graphs["text_full"].infer({"input_ids": ids, "positions": positions})
        return logits, kv

    def cached(self, ids: np.ndarray, positions: np.ndarray, past: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, kv = self.graphs["text_cached"].infer({"input_ids": ids, "positions": positions, "past_kv": past})
        return logits, kv

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _fits(self, length: int, field_name: str) -> None:
        if length > self.manifest.max_len:
            raise RequestError(f"{field_name}: the text needs {length} tokens, past the model's {self.manifest.max_len}; "
                               "shorten the prompt or lower max_tokens", field=field_name, code="too_long")  # fmt: skip

    def complete(self, prompt: str, max_tokens: int, n: int = 1, decoding: Decoding = Decoding(),
                 seeds: Optional[Sequence[int]] = None, stop: Sequence[str] = (),
                 rows: Optional[Sequence[Row]] = None, on_text: Optional[Callable[[int, str], None]] = None) -> TextResult:  # fmt: skip
        """Continuations of ``prompt``, each up to ``max_tokens`` tokens: ``n`` rows (seeds 0..n-1,
        or ``seeds``) or ``rows``, each with its seed, temperature and instruction line. Rows whose
        texts are as long (in tokens) run as one batch; rows of one text share its first step and
        its cache. ``on_text(row, text)``: row ``row``'s text so far, as each block (autoregressive:
        each token) is done, always a prefix of the text it ends with (streaming); what it raises
        ends the call."""
        decoding = decoding.check()
        if rows is None:
            rows = [Row(seed) for seed in (seeds if seeds is not None else range(n))]
        if not rows:
            raise RequestError("n: no row to continue; ask for at least one", field="n")
        if max_tokens < 1:
            raise RequestError(f"max_tokens: {max_tokens} must be at least 1", field="max_tokens")
        texts = [prompt if r.instruction is None else f"{r.instruction.rstrip(chr(10))}\n{prompt}" for r in rows]
        encoded = [self.encode(t) for t in texts]
        if not all(encoded):
            raise RequestError("prompt: empty; give the text to continue", field="prompt")
        for k, ids in enumerate(encoded):
            self._fits(len(ids) + max_tokens, "max_tokens" if len(ids) < self.manifest.max_len else f"rows[{k}]")
        groups: dict[int, list[int]] = {}
        for k, ids in enumerate(encoded):
            groups.setdefault(len(ids), []).append(k)
        t0 = time.perf_counter()
        out: list = [None] * len(rows)
        stats = DecodeStats()
        cap = self.max_rows or len(rows)
        pieces = [members[i:i + cap] for members in groups.values() for i in range(0, len(members), cap)]
        for members in pieces:
            prompts = np.array([encoded[k] for k in members])
            temps = [decoding.temperature if rows[k].temperature is None else rows[k].temperature for k in members]
            progress = None if on_text is None else _Progress(self, members, prompts.shape[1], stop, on_text)
            ids, part = self._decode(prompts, max_tokens, decoding, [rows[k].seed for k in members], temps, progress)
            stats.merge(part)
            for j, k in enumerate(members):
                out[k] = ids[j]
        return self._result(out, [len(e) for e in encoded], stats, time.perf_counter() - t0, stop)

    def _decode(self, prompts: np.ndarray, max_tokens: int, decoding: Decoding, seeds: list[int],
                temperatures: list[float], progress: Optional["_Progress"] = None) -> tuple[np.ndarray, DecodeStats]:  # fmt: skip
        m, n = self.manifest, len(prompts)
        if m.causal:
            if n > 1 and not (prompts == prompts[:1]).all():  # the loop shares one prompt: rows of several run apart
                parts = [self._decode(prompts[k:k + 1], max_tokens, decoding, seeds[k:k + 1], temperatures[k:k + 1],
                                      None if progress is None else progress.row(k)) for k in range(n)]  # fmt: skip
                stats = DecodeStats()
                for _, part in parts:
                    stats.merge(part)
                return np.concatenate([ids for ids, _ in parts]), stats
            def on_token(out: np.ndarray) -> None:  # the continuations so far, after their prompt
                progress(np.concatenate([prompts, out], axis=1), prompts.shape[1] + out.shape[1])

            out, stats = decode_autoregressive(self, prompts[0], max_tokens, m.eos_id, temperature=temperatures, seeds=seeds, rows=n,
                                               on_token=None if progress is None else on_token)  # fmt: skip
            return np.concatenate([prompts, out], axis=1), stats
        x = np.concatenate([prompts, np.full((n, max_tokens), m.mask_id)], axis=1)
        region = np.arange(x.shape[1]) >= prompts.shape[1]
        return decode_masked(self, x, region, m.mask_id, block_length=decoding.block_length, steps=decoding.steps,
                             threshold=decoding.threshold, edit_threshold=decoding.edit_threshold, edit_rounds=decoding.edit_rounds,
                             cache=decoding.cache, temperature=temperatures, seeds=seeds, stop_id=m.eos_id, on_block=progress)  # fmt: skip

    def span_edit(self, result: "TextResult", row: int, span: tuple[int, int], decoding: Decoding = Decoding(),
                  seeds: Sequence[int] = (0,), temperature: float = 0.0, stop: Sequence[str] = ()) -> "TextResult":  # fmt: skip
        """Row ``row`` of ``result`` with its continuation's tokens ``span`` = (a, b) re-masked and
        decoded again, as one batch of ``len(seeds)`` rows (one block: the span; the cache kept
        outside it when ``decoding.cache`` is not none, so a step runs the span alone under "dual").
        Every token outside the span is the row's, exactly. A masked-diffusion model's operation."""
        m = self.manifest
        if m.causal:
            raise RequestError("edits: an autoregressive model cannot decode a span between kept tokens; use a masked-diffusion model",
                               field="edits", code="not_a_diffusion_model")  # fmt: skip
        start, ids = result.starts[row], np.asarray(result.ids[row])
        a, b = span
        decoded_length = result.tokens[row]
        if not 0 <= a < b <= decoded_length:
            raise RequestError(f"edits: span [{a}, {b}] is not inside the continuation's {decoded_length} tokens", field="edits")
        where = np.zeros(len(ids), dtype=bool)
        where[start + a: start + b] = True
        masked = np.where(where, m.mask_id, ids)
        t0 = time.perf_counter()
        out, stats, cap = [], DecodeStats(), self.max_rows or len(seeds)
        for i in range(0, len(seeds), cap):
            piece = list(seeds[i:i + cap])
            x, part = decode_masked(self, np.tile(masked, (len(piece), 1)), where, m.mask_id, threshold=decoding.threshold,
                                    steps=decoding.steps, edit_threshold=decoding.edit_threshold, edit_rounds=decoding.edit_rounds,
                                    cache=decoding.cache, temperature=temperature, seeds=piece)  # fmt: skip
            out.extend(x)
            stats.merge(part)
        return self._result(out, [start] * len(seeds), stats, time.perf_counter() - t0, stop)

    def style_pass(self, result: "TextResult", style: Style = Style(), rows: Optional[Sequence[int]] = None,
                   stop: Sequence[str] = ()) -> "TextResult":  # fmt: skip
        """Rows ``rows`` (None: every row) of a finished ``result`` made consistent: each
        continuation's tokens read again masked, ``style.groups`` masked copies of a text a round
        (a token is predicted from every other token of the text), and those the model now predicts
        otherwise with probability >= ``style.edit_threshold`` replaced, for up to ``style.rounds``
        rounds (one that changes nothing ends it). ``style.instruction``: a line put before the text
        while it runs (``# snake_case names``, say), not in what comes back. The prompt, and what
        follows a row's end, are kept exactly. Rows whose texts have one layout (as a call of
        ``complete`` makes them) are one batch. A masked-diffusion model's operation (an
        autoregressive one sees no later token)."""
        m = self.manifest
        if m.causal:
            raise RequestError("style: an autoregressive model cannot re-read a token in the light of later ones; use a "
                               "masked-diffusion model", field="style", code="not_a_diffusion_model")  # fmt: skip
        if not 0.0 < style.edit_threshold <= 1.0:
            raise RequestError(f"style.edit_threshold: {style.edit_threshold:g} is outside (0, 1]", field="style.edit_threshold")
        if style.rounds < 1:
            raise RequestError(f"style.rounds: {style.rounds} must be at least 1", field="style.rounds")
        if style.cache not in ("none", "prefix"):
            raise RequestError(f"style.cache: {style.cache!r}; none or prefix (every token is queried: nothing but the prompt "
                               "is outside them)", field="style.cache")  # fmt: skip
        if not 1 <= style.groups <= (self.max_rows or style.groups):
            raise RequestError(f"style.groups: {style.groups} must be at least 1 and at most the engines' {self.max_rows} rows a call",
                               field="style.groups")  # fmt: skip
        rows = list(range(len(result.ids))) if rows is None else list(rows)
        head = self.encode(style.instruction.rstrip("\n") + "\n") if style.instruction else []
        groups: dict[tuple, list[int]] = {}
        for k in rows:
            if not 0 <= k < len(result.ids):
                raise RequestError(f"style.rows: {k} is not a row of the result's {len(result.ids)}", field="style.rows")
            groups.setdefault((len(result.ids[k]), result.starts[k], result.tokens[k]), []).append(k)
        out, stats, t0 = {}, DecodeStats(), time.perf_counter()
        for (length, start, tokens), members in groups.items():
            self._fits(len(head) + length, "style.instruction")
            region = np.zeros(len(head) + length, dtype=bool)
            region[len(head) + start: len(head) + start + tokens] = True
            cap = max(1, (self.max_rows or len(members) * style.groups) // style.groups)  # a text's groups are rows of one call
            for i in range(0, len(members), cap):
                piece = members[i:i + cap]
                x = np.array([np.concatenate([np.asarray(head, dtype=np.int64), result.ids[k]]) for k in piece])
                styled, part = restyle(self, x, region, m.mask_id, edit_threshold=style.edit_threshold, rounds=style.rounds,
                                       groups=style.groups, cache=style.cache)  # fmt: skip
                stats.merge(part)
                out.update({k: styled[j, len(head):] for j, k in enumerate(piece)})
        return self._result([out[k] for k in rows], [result.starts[k] for k in rows], stats, time.perf_counter() - t0, stop)

    def base_of(self, prompt: str, completion: str) -> "TextResult":
        """A text a client sends back (its prompt and the completion it was given, edited or not)
        as a one-row result that span edits and style passes take: the prompt's tokens, then the
        completion's, each tokenized alone (their boundary kept), then the end-of-text id."""
        m = self.manifest
        head, body = self.encode(prompt), self.encode(completion)
        if not head:
            raise RequestError("prompt: empty; give the text the completion continues", field="prompt")
        if not body:
            raise RequestError("completion: empty; give the text to edit", field="completion")
        self._fits(len(head) + len(body) + 1, "completion")
        ids = np.array(head + body + [m.eos_id], dtype=np.int64)
        return TextResult([ids], [len(head)], [completion], ["stop"], DecodeStats(), 0.0, [len(body)])

    def char_span(self, result: "TextResult", row: int, chars: tuple[int, int], field: str = "chars") -> tuple[int, int]:
        """The continuation's tokens (a, b) that write any of its characters ``chars`` = [a, b)."""
        pieces, offsets = self._pieces(result, row)
        a, b = chars
        inside = [k for k in range(len(pieces)) if offsets[k] < b and offsets[k + 1] > a]
        if b <= a or not inside:
            raise RequestError(f"{field}: [{a}, {b}] holds none of the completion's {offsets[-1]} characters", field=field)
        return inside[0], inside[-1] + 1

    def line_span(self, result: "TextResult", row: int, lines: tuple[int, int], field: str = "edits") -> tuple[int, int]:
        """The continuation's tokens (a, b) that write any character of its lines ``lines``
        (0 the first line; whole tokens, so a token holding a line break belongs to both lines)."""
        pieces, offsets = self._pieces(result, row)
        text = "".join(pieces)
        line_of = lambda c: text.count("\n", 0, c)  # noqa: E731  (the line character c is on)
        a, b = lines
        inside = [k for k, p in enumerate(pieces) if p and line_of(offsets[k]) < b and line_of(offsets[k + 1] - 1) >= a]
        if b <= a or not inside:
            raise RequestError(f"{field}: lines [{a}, {b}] hold none of the continuation's {text.count(chr(10)) + 1} lines",
                               field=field)  # fmt: skip
        return inside[0], inside[-1] + 1

    def _pieces(self, result: "TextResult", row: int) -> tuple[list[str], np.ndarray]:
        """Row ``row``'s continuation as each token's text, and where each starts (characters)."""
        start = result.starts[row]
        pieces = [self.decode([int(t)]) for t in result.ids[row][start: start + result.tokens[row]]]
        return pieces, np.cumsum([0] + [len(p) for p in pieces])

    def _result(self, ids: list, starts: list[int], stats: DecodeStats, seconds: float, stop: Sequence[str]) -> TextResult:
        texts, reasons, tokens = [], [], []
        for row, start in zip(ids, starts):
            text, ended, count = self._cut(row[start:], stop)
            texts.append(text)
            reasons.append("stop" if ended else "length")
            tokens.append(count)
        return TextResult(ids, starts, texts, reasons, stats, seconds, tokens)

    def _cut(self, continuation, stop: Sequence[str]) -> tuple[str, bool, int]:
        """A continuation's text up to its end (the end-of-text id, a mask left, a stop string),
        whether it ended, and its tokens before the end-of-text id."""
        m = self.manifest
        region = [int(t) for t in continuation]
        ended = m.eos_id in region or m.mask_id in region
        if ended:
            region = region[: min(region.index(t) for t in (m.eos_id, m.mask_id) if t in region)]
        text = self.decode(region)
        hits = [text.index(s) for s in stop if s and s in text]
        if hits:
            text, ended = text[: min(hits)], True
        return text, ended, len(region)


class _Progress:
    """A call's ``on_text(row, text)``: each row's text so far as blocks (or, autoregressive,
    tokens) finish, only ever a prefix of its final text: held back by a stop string's length less
    one (a stop may begin there) and by a character whose bytes are not all written yet."""

    def __init__(self, pipe: TextPipeline, members: list[int], start: int, stop: Sequence[str], on_text: Callable[[int, str], None]):
        self.pipe, self.members, self.start, self.stop, self.on_text = pipe, members, start, stop, on_text
        self.hold = max((len(s) for s in stop if s), default=1) - 1
        self.sent = {k: 0 for k in members}

    def row(self, j: int) -> "_Progress":
        """The progress of the call's row ``j`` alone (a row run apart from the others)."""
        return _Progress(self.pipe, self.members[j:j + 1], self.start, self.stop, self.on_text)

    def __call__(self, ids: np.ndarray, end: int) -> None:
        for j, k in enumerate(self.members):
            text, ended, _ = self.pipe._cut(ids[j, self.start:end], self.stop)
            if not ended:
                text = text[: len(text) - self.hold].rstrip("\ufffd")
            if len(text) > self.sent[k]:
                self.sent[k] = len(text)
                self.on_text(k, text)
