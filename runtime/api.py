"""The HTTP API's request bodies and its one error shape.

Bodies follow the OpenAI Images API where it has a field (``prompt``, ``size``,
``response_format``) and AUTOMATIC1111's API otherwise (``negative_prompt``, ``steps``,
``cfg_scale``, ``seed`` with -1 for random). Every error is
``{"error": {"message", "type", "param", "code"}}`` with ``param`` a JSON path such as
``edits[3].strength``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str = Field(min_length=1, description="The base prompt.")
    negative_prompt: str = Field("", description="Shared by the base and all its edits.")
    size: Optional[str] = Field(None, pattern=r"^\d{1,5}x\d{1,5}$", description="WxH in pixels; the server's size by default.")
    steps: Optional[int] = Field(None, ge=1, description="DDIM steps; the server's default if omitted.")
    cfg_scale: Optional[float] = Field(None, ge=0, le=50, description="Classifier-free guidance; <= 1 turns it off.")
    seed: int = Field(-1, ge=-1, le=2**63 - 1, description="-1 picks a random seed (returned).")
    response_format: Literal["b64_json"] = "b64_json"


class MaskRect(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    x: int = Field(ge=0)
    y: int = Field(ge=0)
    width: int = Field(gt=0)
    height: int = Field(gt=0)


class EditItem(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str = Field(min_length=1, description="The edit's target prompt.")
    strength: Optional[float] = Field(None, ge=0, le=2, description="K/V = base + strength x (edit - base); the server's default if omitted.")
    tail_steps: Optional[int] = Field(None, ge=1, description="Steps to re-run; the server's default tail if omitted.")
    mask: Optional[MaskRect] = Field(None, description="Pixels inside may change; outside stays the base.")
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1, description="A variation: re-noise with this seed.")
    cfg_scale: Optional[float] = Field(None, ge=0, le=50, description="Guidance for this edit; the base's if omitted.")
    preserve: Optional[Literal["auto", "none"]] = Field(
        None, description="auto: only where the changed words attend may the image change; the server's default if omitted."
    )


class EditsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    base_id: str = Field(min_length=1, max_length=64)
    edits: list[EditItem] = Field(min_length=1)
    stream: bool = Field(False, description="Server-Sent Events: queue, progress, image_edit.completed, done.")


class ApiError(Exception):
    """An error the API reports in its one shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def json_path(loc: Sequence[Any]) -> Optional[str]:
    """('body', 'edits', 3, 'strength') -> 'edits[3].strength'."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def validation_error(errors: Sequence[dict]) -> ApiError:
    first = errors[0]
    param = json_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return ApiError(422, "the body is not valid JSON", code="json_invalid")
    if first.get("type") == "missing":
        message = f"{param}: required field missing"
    elif first.get("type") == "extra_forbidden":
        message = f"{param}: unknown field"
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return ApiError(422, message + more, param=param, code=first.get("type"))
