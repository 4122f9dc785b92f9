"""The ``serve:`` section of a run config: `edit-rt serve`'s limits, Ray Serve scale-out and
related generations (load.py reads it with the rest of run_config.py's sections; each field's reason beside it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import AfterValidator, ConfigDict, ValidationInfo, field_validator, with_config

from ..model.schema import Bool, Float, Int, Str, between

STRICT = ConfigDict(extra="forbid")
Seconds = between(Float, 0.0, lo_open=True)


@with_config(STRICT)
@dataclass(frozen=True)
class RayServe:
    """`edit-rt serve CONFIG --ray`: the same API on Ray Serve, in front of N replicas."""

    # Workers, each with its own engine set, batcher and RAM tier; they share store.disk_dir.
    replicas: between(Int, 1) = 2
    cpus_per_replica: between(Float, 0.0) = 1.0
    gpus_per_replica: between(Float, 0.0) = 0.0
    # A running cluster ("ray://head:10001" or "auto"); RAY_ADDRESS overrides; none starts a
    # local Ray instance.
    address: Optional[Str] = None
    # Requests one replica takes at once: they queue in its batcher, which batches them, so this
    # is well above Ray Serve's default of 5.
    max_ongoing_requests: between(Int, 1) = 64
    # Where each base was placed, kept by the ingress for routing (the least recent go first;
    # a base it forgot is routed by rendezvous hashing, then remembered again).
    placements: between(Int, 1) = 100_000
    # affinity: a request that names a base goes to the replica holding it (ray_serve.py);
    # power_of_two: Ray Serve's default router, which ignores the base (for comparison).
    routing: Literal["affinity", "power_of_two"] = "affinity"
    # affinity: a request goes past the replicas holding its base only when each of them has
    # more requests in flight than load_bound x the mean, plus one (a large value: never).
    load_bound: between(Float, 1.0) = 2.0

@with_config(STRICT)
@dataclass(frozen=True)
class Threshold:
    """One step of the related-generation policy: a prompt at least ``similarity`` close to a
    stored base's starts from that base's state with ``skip`` of its steps skipped."""

    similarity: between(Float, 0.0, 1.0, lo_open=True)
    skip: between(Float, 0.0, 1.0, lo_open=True, hi_open=True)


@with_config(STRICT)
@dataclass(frozen=True)
class Related:
    """Related generations (runtime/serving/related.py): a generation whose prompt is close to
    a stored base's runs as that base's edit tail at strength 1 (NIRVANA's approximate caching)."""

    # Off by default: a related result is an approximation of the exact generation; a request
    # says `related: true` to ask, or `false` to refuse, and one with its own seed is exact
    # unless it asks.
    enabled: Bool = False
    # Cosine similarity of the prompts' mean-token text embeddings -> the fraction of steps
    # skipped, ascending in both (the closer, the later the entry); below the first, a
    # generation from scratch. Chosen by `make related` on the shapes world (docs/related.md):
    # a repeat of a stored prompt (0.99999: no two different prompts there score above 0.99995)
    # skips 95% of the steps, 70% of the rows saved on its stream with prompt following within
    # noise; near-repeats at any lower threshold kept their base's layout (position -0.13).
    thresholds: tuple[Threshold, ...] = (Threshold(0.99999, 0.95),)
    # The prompt embedding compared: "mean", the mean of the text encoder's hidden states over
    # the prompt's tokens; "eos", the hidden state at its EOS token (CLIP's pooled position).
    # docs/related.md measures what each calls close.
    embedding: Literal["mean", "eos"] = "mean"
    # Whether a related reply names the stored base it started from (info.related's base_id,
    # X-Edit-RT-Related's base=, the PNG's Related base). Off: that base may be another
    # client's, and its id is all it takes to read, edit or delete it; the reply still says it
    # was related and how many steps it skipped. On where every client may use every base.
    share_bases: Bool = False


def api_auth_pairs(value: str) -> list[tuple[str, str]]:
    """``serve.api_auth`` (AUTOMATIC1111's ``--api-auth``: ``user:password``, several joined by
    commas) as its (user, password) pairs, split at each pair's first colon (a user cannot hold
    one, a password can; neither can hold a comma). A ValueError names the pair by its place,
    never its text: the text holds a password."""
    fix = "write user:password, several joined by a comma alone (user:password,user2:password2)"
    pairs = []
    for place, pair in enumerate(value.split(","), 1):
        user, colon, password = pair.partition(":")
        where = f"pair {place}" if "," in value else "the pair"
        if not colon:
            raise ValueError(f"{where} has no colon; {fix}")
        if not user:
            raise ValueError(f"{where} has an empty user; {fix}")
        if user != user.strip():
            raise ValueError(f"{where}'s user starts or ends with a space; {fix}")
        pairs.append((user, password))
    return pairs


def _checked_api_auth(value: str) -> str:
    api_auth_pairs(value)
    return value


ApiAuth = Annotated[Str, AfterValidator(_checked_api_auth)]


def token_refusal(value: str, unset: str) -> Optional[str]:
    """Why no client could ever send ``value`` as its bearer token, or None (``unset``: how to
    serve without it). An HTTP header value loses its surrounding spaces and tabs on the way
    (RFC 9110 5.5; h11 strips them), so " " or "abc " never matches what arrives; a control
    character (a newline) cannot be sent in a header at all."""
    if not value:
        return f"empty; set a token of visible characters, or {unset}"
    if not value.strip():
        return (f"blank, which no client can send (a header loses surrounding spaces); set a token of visible "
                f"characters, or {unset}")  # fmt: skip
    if value != value.strip():
        return ("starts or ends with whitespace, which a client's Authorization header loses, so no request "
                "could ever match it; remove the surrounding whitespace")  # fmt: skip
    if any(ord(c) < 32 and c != "\t" or ord(c) == 127 for c in value):
        return "holds a control character (a newline?), which no HTTP header can carry; remove it"
    return None


def _checked_token(value: str) -> str:
    refusal = token_refusal(value, "remove the key to serve without one")
    if refusal is not None:
        raise ValueError(refusal)
    return value


Token = Annotated[Str, AfterValidator(_checked_token)]


@with_config(STRICT)
@dataclass(frozen=True)
class Serve:
    """`edit-rt serve`: where it listens and what it accepts."""

    # Loopback by default: exposing the service is a deliberate choice (and wants `token`).
    host: Str = "127.0.0.1"
    port: between(Int, 0, 65535) = 8188
    # Bearer token for /v1/*, /sdapi/* and /metrics; EDIT_RT_TOKEN in the environment overrides it.
    # Refused blank or with surrounding whitespace: a header would never bring it back whole.
    token: Optional[Token] = None
    # HTTP Basic users for the same paths, as AUTOMATIC1111's --api-auth ("user:password",
    # several comma-separated; webuiapi's set_auth sends them); EDIT_RT_API_AUTH overrides it.
    # With a token too, either gets in.
    api_auth: Optional[ApiAuth] = None
    max_edits_per_request: between(Int, 1) = 64
    # Rows waiting for a batch slot; past this a request gets 429 with Retry-After.
    queue_limit: between(Int, 1) = 256
    max_prompt_chars: between(Int, 1) = 500
    # Room for an uploaded image (multipart or base64 JSON) besides the rest of a body.
    max_body_bytes: between(Int, 1) = 16_000_000
    # An uploaded image's own bytes; one of another size is resized to the served size (or,
    # with resize_uploads false, refused with the size it must have).
    max_image_bytes: between(Int, 1) = 10_000_000
    # An upload's declared width x height, refused (413) before a pixel is decoded: a few KB
    # of PNG can declare gigapixels. 25 M takes a 24-megapixel camera photo (6000x4000); such
    # a decode peaks at 100 MB (Pillow holds 4 bytes a pixel), 200 MB when its mode is
    # converted (RGBA, 16-bit), per image_workers thread.
    max_image_pixels: between(Int, 1) = 25_000_000
    resize_uploads: Bool = True
    # Threads that decode uploads (their own pool: a burst of big images queues there, never
    # in the threads store reads use); each holds one decoded image at a time.
    image_workers: between(Int, 1, 64) = 2
    # One image task's deadline (an upload's decode, a mask's, its blur), its wait for a worker
    # included: past it the request gets 503 `image_timeout` (Retry-After) and a task not yet
    # started is dropped. A running one cannot be stopped (a thread cannot be killed): its
    # result is discarded, and max_image_pixels bounds how long it holds its worker (a 25 Mpx
    # decode takes about a second, a mask's blur runs at the served size). 30 s is far past
    # that, so only a pool backed up by many large images reaches it.
    image_timeout_s: Seconds = 30.0
    max_steps: between(Int, 1) = 150
    # A request whose rows are not done by then is dropped at the next step boundary.
    request_timeout_s: Seconds = 600.0
    # On SIGTERM: new requests get 503 at once; rows in flight get this long to finish.
    drain_timeout_s: Seconds = 30.0
    # Slow or stalled clients: a request head must arrive within header_timeout_s of the
    # connection, and a body must not stall for body_timeout_s.
    header_timeout_s: Seconds = 10.0
    body_timeout_s: Seconds = 30.0
    # ComfyUI's API (web/api_comfyui.py: /prompt, /queue, /history, /view, /ws, ...) beside the
    # other doors. Off by default: its paths are ComfyUI's bare ones (/prompt, /view), which
    # nothing else here claims, and a server that does not speak ComfyUI should answer 404 there.
    comfyui: Bool = False
    # ComfyUI's own frontend (comfyui-frontend-package, the `comfyui` extra) at / (web/comfyui_frontend.py),
    # the editing page then at /editor only. Off by default: it is 120 MB of someone else's
    # page, and it needs comfyui: true, whose routes it calls.
    comfyui_frontend: Bool = False
    # Where the frontend keeps each user's settings and workflows (users.json, a folder per
    # user); relative to the config's folder. None: <output_dir>/comfyui/user, beside the
    # outputs as ComfyUI keeps its user/ folder.
    comfyui_user_dir: Optional[Path] = None
    ray: RayServe = field(default_factory=RayServe)
    related: Related = field(default_factory=Related)

    @field_validator("comfyui_frontend")
    @classmethod
    def _frontend_needs_its_door_and_package(cls, on: bool, info: ValidationInfo) -> bool:
        if on and not info.data.get("comfyui"):
            raise ValueError("true needs ComfyUI's API, whose routes the frontend calls; set serve.comfyui: true too, "
                             "or set comfyui_frontend false")  # fmt: skip
        if on and find_spec("comfyui_frontend_package") is None:
            raise ValueError("true needs ComfyUI's frontend, which is not installed; pip install 'edit-rt[comfyui]' "
                             "(comfyui-frontend-package), or set comfyui_frontend false")  # fmt: skip
        return on
