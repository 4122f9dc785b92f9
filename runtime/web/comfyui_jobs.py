"""ComfyUI's ``/jobs`` view of the door's queue and history, which its frontend's queue panel
reads (``/jobs?status=...``, ``/jobs/{id}``) and cancels through (``/jobs/{id}/cancel``,
``/jobs/cancel``), as ComfyUI's comfy_execution/jobs.py shapes it.

A job is a prompt: ``in_progress`` while it runs, ``pending`` while it waits, then ``completed``,
``failed`` or ``cancelled`` (interrupted) from its history entry, with the first image it wrote
as its ``preview_output``. Listed in the order the queue holds them (running, pending, then the
history newest first); ``create_time`` is the client's ``extra_data.create_time`` when it sent
one, else when the prompt started (ms), else 0 (a number the frontend's schema requires).
"""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Depends, Request as HttpRequest

from .api_comfyui import checked, door_of, json_body
from .http_errors import ApiError

STATUSES = ("pending", "in_progress", "completed", "failed", "cancelled")
MAX_LIMIT = 1000


def _started_ms(messages: list) -> Optional[int]:
    return next((m[1].get("timestamp") for m in messages if m[0] == "execution_start" and isinstance(m[1], dict)), None)


def queued_job(item, status: str) -> dict:
    """A running or pending prompt (comfyui_queue.Item) as a job."""
    created = item.extra_data.get("create_time") if isinstance(item.extra_data, dict) else None
    job = {"id": item.prompt_id, "status": status, "priority": item.number,
           "create_time": created if isinstance(created, int) else (_started_ms(item.messages) or 0),
           "outputs_count": 0, "previewable_outputs_count": 0}  # fmt: skip
    workflow_id = _workflow_id(item.extra_data)
    return {**job, "workflow_id": workflow_id} if workflow_id else job


def history_job(prompt_id: str, entry: dict, detail: bool = False) -> dict:
    """A finished prompt's history entry as a job (with its outputs and workflow: ``detail``)."""
    number, _, prompt, extra, _ = entry["prompt"]
    status_info = entry.get("status") or {}
    messages = [m for m in status_info.get("messages", []) if isinstance(m, (list, tuple)) and len(m) >= 2]
    ended = [m for m in messages if m[0] in ("execution_success", "execution_error", "execution_interrupted")]
    if any(m[0] == "execution_interrupted" for m in messages):
        status = "cancelled"
    else:
        status = "failed" if status_info.get("status_str") == "error" else "completed"
    created = extra.get("create_time") if isinstance(extra, dict) else None
    started = _started_ms(messages)
    outputs = entry.get("outputs") or {}
    images = [(node, image) for node, out in outputs.items() for image in (out or {}).get("images", [])]
    job = {"id": prompt_id, "status": status, "priority": number,
           "create_time": created if isinstance(created, int) else (started or 0),
           "execution_start_time": started, "execution_end_time": ended[-1][1].get("timestamp") if ended else None,
           "outputs_count": len(images), "previewable_outputs_count": len(images),
           "preview_output": {**images[0][1], "nodeId": images[0][0], "mediaType": "images"} if images else None}  # fmt: skip
    error = next((m[1] for m in messages if m[0] == "execution_error"), None)
    if error is not None:  # the frontend's schema wants these as strings (a node id may be None here)
        text = {key: str(error.get(key) or "") for key in ("node_id", "node_type", "exception_message", "exception_type")}
        job["execution_error"] = {**error, **text, "traceback": list(error.get("traceback") or [])}
    workflow_id = _workflow_id(extra)
    if workflow_id:
        job["workflow_id"] = workflow_id
    if detail:
        job.update(outputs=outputs, execution_status=status_info, workflow={"prompt": prompt, "extra_data": extra})
    return job


def _workflow_id(extra: object) -> Optional[str]:
    info = extra.get("extra_pnginfo") if isinstance(extra, dict) else None
    workflow = info.get("workflow") if isinstance(info, dict) else None
    found = workflow.get("id") if isinstance(workflow, dict) else None
    return found if isinstance(found, str) else None


def all_jobs(queue) -> list[dict]:
    """Every job of the door's queue (comfyui_queue.PromptQueue), in the order listed above."""
    return ([queued_job(item, "in_progress") for item in queue.running.values()]
            + [queued_job(item, "pending") for item in queue.pending]
            + [history_job(pid, entry) for pid, entry in reversed(queue.history.items())])  # fmt: skip


routes = APIRouter(tags=["ComfyUI frontend"], dependencies=[Depends(checked)])


@routes.get("/jobs", summary="The door's prompts as jobs, filtered by status, a page at a time")
async def jobs(request: HttpRequest, status: str = ",".join(STATUSES), limit: int = 200, offset: int = 0,
               workflow_id: Optional[str] = None):  # fmt: skip
    wanted = {s.strip() for s in status.split(",") if s.strip()}
    if not wanted <= set(STATUSES):
        raise ApiError(400, f"status: {', '.join(sorted(wanted - set(STATUSES)))[:100]}; send some of {', '.join(STATUSES)}",
                       param="status", code="invalid_value")  # fmt: skip
    if not (0 <= limit <= MAX_LIMIT and offset >= 0):
        raise ApiError(400, f"limit: 0..{MAX_LIMIT}, offset: 0 or more", param="limit", code="invalid_value")
    found = [j for j in all_jobs(door_of(request).queue) if j["status"] in wanted
             and (workflow_id is None or j.get("workflow_id") == workflow_id)]  # fmt: skip
    page = found[offset : offset + limit]
    return {"jobs": page, "pagination": {"offset": offset, "limit": limit, "total": len(found),
                                         "has_more": offset + len(page) < len(found)}}  # fmt: skip


@routes.get("/jobs/{job_id}", summary="One job, with its outputs and workflow once it finished")
async def job(job_id: str, request: HttpRequest):
    queue = door_of(request).queue
    if job_id in queue.history:
        return history_job(job_id, queue.history[job_id], detail=True)
    for found in all_jobs(queue):
        if found["id"] == job_id:
            return found
    raise ApiError(404, f"job_id: no job {job_id[:100]!r} here", "not_found_error", param="job_id", code="not_found")


async def cancel(queue, job_ids: list[str]) -> None:
    """Pending ones leave the queue; running ones are interrupted (this door's rows only)."""
    queue.delete(job_ids)
    for pid in job_ids:
        if pid in queue.running:
            await queue.interrupt(pid)


@routes.post("/jobs/cancel", summary="Cancel jobs by id")
async def cancel_jobs(request: HttpRequest):
    ids = (await json_body(request)).get("job_ids")
    if not isinstance(ids, list) or len(ids) > MAX_LIMIT:
        raise ApiError(400, f"job_ids: send a list of at most {MAX_LIMIT} job ids", param="job_ids", code="invalid_value")
    await cancel(door_of(request).queue, [str(i) for i in ids])
    return {}


@routes.post("/jobs/{job_id}/cancel", summary="Cancel one job")
async def cancel_job(job_id: str, request: HttpRequest):
    await cancel(door_of(request).queue, [job_id])
    return {}
