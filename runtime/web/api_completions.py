"""OpenAI's completions door for a text model (issue 56): ``POST /v1/completions`` (``prompt``,
``n``, ``max_tokens``, ``stop``, ``temperature``, ``seed``, ``stream``) and ``GET /v1/models``, with
edit-rt's ``POST /v1/text/edits`` (a span of a completion decoded again n ways, or a style pass), on
the server `edit-rt serve` starts for a text config (server.py ``create_text_app``), behind the
image server's gate, body limits and error bodies.

The ``n`` continuations are one batch of the decoding loop (their prompt's K/V shared). With
``stream``, each choice's text is sent as the decoding finishes it: a masked-diffusion model's
block by block (a block's tokens are final once it is done), an autoregressive model's token by
token, each event a choice's new text (held back while a stop string may be starting), then
OpenAI's closing events with each ``finish_reason`` and ``[DONE]``. A client that leaves ends
its decoding at the next block. The decoding's own settings may be given beside OpenAI's fields
(``threshold``, ``block_length``, ``cache``, ``edit_threshold``), the config's otherwise; ``style``
runs a style pass over every finished continuation before they are sent.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal, Optional, Union

from fastapi import APIRouter, Depends, Request as HttpRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..pipeline.text_pipeline import Decoding, Row, Style, TextResult
from ..serving.text_service import TextService
from .api import errors

router = APIRouter()


def text_service_of(request: HttpRequest) -> TextService:
    return request.app.state.service  # a text config's app: its TextService


TextServiceDep = Annotated[TextService, Depends(text_service_of)]


class StyleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    edit_threshold: float = Field(0.9, gt=0.0, le=1.0, description="A token the model, reading it masked, predicts otherwise with p >= this is replaced.")
    rounds: int = Field(2, ge=1, le=64, description="Rounds of the pass at most (one that changes nothing ends it).")
    groups: int = Field(4, ge=1, le=64, description="Masked copies of a text a round, one batch.")
    cache: Literal["none", "prefix"] = "prefix"
    instruction: Optional[str] = Field(None, max_length=1000, description="A line put before each text while the pass runs.")


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = Field(None, description="The served model's name (GET /v1/models); any other is refused.")
    prompt: str = Field(min_length=1, description="The text to continue (one prompt; a list is not served).")
    max_tokens: int = Field(16, ge=1, le=4096, description="Tokens each continuation may write (OpenAI's default: 16).")
    n: int = Field(1, ge=1, description="Continuations, one batch (at most serve.max_edits_per_request).")
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="0: the most confident tokens; OpenAI's default 1.")
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1, description="Continuation k samples with seed + k (default 0).")
    stop: Optional[Union[str, Annotated[list[str], Field(max_length=4)]]] = Field(None, description="Up to 4 strings that end a continuation.")
    stream: bool = False
    threshold: Optional[float] = Field(None, ge=0.0, le=1.0, description="edit-rt: parallel decoding's confidence threshold.")
    block_length: Optional[int] = Field(None, ge=1, le=4096, description="edit-rt: the tokens of a block.")
    cache: Optional[Literal["none", "prefix", "dual"]] = Field(None, description="edit-rt: the K/V reused within a block.")
    edit_threshold: Optional[float] = Field(None, gt=0.0, le=1.0, description="edit-rt: token-to-token editing's threshold.")
    style: Optional[StyleRequest] = Field(None, description="edit-rt: a style pass over every finished continuation (one batch).")


def _choices(result) -> list[dict]:
    return [{"text": text, "index": k, "logprobs": None, "finish_reason": reason}
            for k, (text, reason) in enumerate(zip(result.texts, result.finish_reasons))]  # fmt: skip


@router.get("/v1/models", responses=errors(401))
async def models(service: TextServiceDep):
    m = service.pipe.manifest if service.pipe is not None else None
    return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0, "owned_by": "edit-rt",
                                        "kind": m.kind if m else None}]}  # fmt: skip


@router.post("/v1/completions", responses=errors(400, 401, 413, 429, 503),
             summary="Continue a prompt: n continuations as one batch of the text model's decoding loop")  # fmt: skip
async def completions(body: CompletionRequest, service: TextServiceDep):
    from ..errors import RequestError

    if body.model is not None and body.model != service.model_name:
        raise RequestError(f"model: {body.model!r} is not served here; this server serves {service.model_name!r}", field="model",
                           code="model_not_found")  # fmt: skip
    decoding = Decoding.of(service.cfg.text, threshold=body.threshold, block_length=body.block_length, cache=body.cache,
                                   edit_threshold=body.edit_threshold, temperature=body.temperature)  # fmt: skip
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    seed = body.seed or 0
    rows = [Row(seed + k) for k in range(body.n)]
    ident, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    head = {"id": ident, "object": "text_completion", "created": created, "model": service.model_name}
    prompt_tokens = len(service.encode(body.prompt))
    if not body.stream or body.style is not None:  # a style pass reads whole texts: it streams as one event a choice
        result = await service.complete(body.prompt, body.max_tokens, rows, decoding, stop)
        if body.style is not None:
            result = await service.style_pass(result, Style(**body.style.model_dump()), stop)
        if not body.stream:
            return {**head, "choices": _choices(result), "usage": _usage(prompt_tokens, result)}
        progress = _whole(result)
    else:
        progress = service.stream(body.prompt, body.max_tokens, rows, decoding, stop)
    first = await anext(progress)  # a refusal is an error answer, not a broken stream

    async def events():
        sent = [""] * body.n
        item = first
        try:
            while not isinstance(item, TextResult):  # (row, text so far) until the result
                k, text = item
                yield _event(head, k, text[len(sent[k]):], None)
                sent[k] = text
                item = await anext(progress)
            for k, text in enumerate(item.texts):  # what the last block added (held back or ended)
                if text[len(sent[k]):]:
                    yield _event(head, k, text[len(sent[k]):], None)
            for choice in _choices(item):
                yield _event(head, choice["index"], "", choice["finish_reason"])
            yield "data: [DONE]\n\n"
        finally:
            await progress.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


class TextEditRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = Field(None, description="The served model's name; any other is refused.")
    prompt: str = Field(min_length=1, description="The text the completion continues (kept exactly).")
    completion: str = Field(min_length=1, description="The completion to edit, as the client holds it.")
    lines: Optional[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=2, max_length=2)]] = Field(
        None, description="The completion's lines [a, b) to decode again (0 the first).")
    chars: Optional[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=2, max_length=2)]] = Field(
        None, description="The completion's characters [a, b) to decode again (whole tokens).")
    n: int = Field(1, ge=1, description="Edits of the span, one batch (at most serve.max_edits_per_request).")
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1, description="Edit k samples with seed + k (default 0).")
    stop: Optional[Union[str, Annotated[list[str], Field(max_length=4)]]] = None
    threshold: Optional[float] = Field(None, ge=0.0, le=1.0)
    cache: Optional[Literal["none", "prefix", "dual"]] = None
    edit_threshold: Optional[float] = Field(None, gt=0.0, le=1.0)
    style: Optional[StyleRequest] = Field(None, description="A style pass over each text (after the span's edit, if any).")


@router.post("/v1/text/edits", responses=errors(400, 401, 413, 429, 503),
             summary="Decode a span of a completion again, n ways as one batch, every character outside it kept")  # fmt: skip
async def text_edits(body: TextEditRequest, service: TextServiceDep):
    """edit-rt's own door (OpenAI's edits endpoint is retired): the client sends a prompt and the
    completion it holds, and a span of it (``lines`` or ``chars``); the span's tokens are masked
    and decoded again as ``n`` rows of one batch, the text outside them kept exactly; or a
    ``style`` pass over the whole completion. Stateless: nothing is kept between requests."""
    from ..errors import RequestError

    if body.model is not None and body.model != service.model_name:
        raise RequestError(f"model: {body.model!r} is not served here; this server serves {service.model_name!r}", field="model",
                           code="model_not_found")  # fmt: skip
    if body.lines is not None and body.chars is not None:
        raise RequestError("lines / chars: give one span, lines: [a, b] or chars: [a, b]", field="lines")
    if body.lines is None and body.chars is None and body.style is None:
        raise RequestError("lines: no span and no style; give lines: [a, b], chars: [a, b] or style", field="lines")
    service.ready_for(body.prompt + body.completion)  # before tokenizing them
    pipe = service.pipe
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    base = pipe.base_of(body.prompt, body.completion)
    result = base
    span = None
    if body.lines is not None or body.chars is not None:
        if body.lines is not None:
            span = pipe.line_span(base, 0, tuple(body.lines), "lines")
        else:
            span = pipe.char_span(base, 0, tuple(body.chars))
        decoding = Decoding.of(service.cfg.text, threshold=body.threshold, cache=body.cache, edit_threshold=body.edit_threshold)
        seeds = [(body.seed or 0) + k for k in range(body.n)]
        result = await service.span_edit(base, 0, span, decoding, seeds, body.temperature, stop)
    elif body.n != 1:
        raise RequestError("n: a style pass alone makes one text (it samples nothing); ask for n = 1, or give a span", field="n")
    if body.style is not None:
        result = await service.style_pass(result, Style(**body.style.model_dump()), stop)
    prompt_tokens = len(service.encode(body.prompt))
    return {"id": f"edit-{uuid.uuid4().hex[:24]}", "object": "text_edit", "created": int(time.time()), "model": service.model_name,
            "span_tokens": list(span) if span is not None else None, "choices": _choices(result),
            "usage": _usage(prompt_tokens, result)}  # fmt: skip


def _usage(prompt_tokens: int, result) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": sum(result.tokens), "total_tokens": prompt_tokens + sum(result.tokens)}


def _event(head: dict, index: int, text: str, finish_reason: Optional[str]) -> str:
    choice = {"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}
    return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"


async def _whole(result):
    """A finished result as a stream of one text a choice."""
    for k, text in enumerate(result.texts):
        yield k, text
    yield result
