"""AUTOMATIC1111's job control, options and listings (``/sdapi/v1/...``), so ``webuiapi``'s
``util_wait_for_ready``, ``interrupt``, ``skip``, ``get_samplers``, ``set_options`` and the
like work against edit-rt as against A1111.

- ``GET /progress``: of this door's requests only (another door's are no job: A1111's own is
  one queue): 0.0 and ``state.job_count`` 0 when idle; while rows run, the fraction of the
  row-steps of its requests in flight that are done (running and queued rows alike),
  ``eta_relative`` as A1111 computes it (elapsed / progress - elapsed), the oldest running
  row's ``sampling_step`` of ``sampling_steps``, ``textinfo`` its requests and rows,
  ``current_image`` its latest preview (with Ray Serve none: previews stay on the replicas).
- ``POST /interrupt``, ``/skip``: this door's requests running now (a row in a step loop) stop
  at the next step; a request wholly queued, or another door's, goes on. A1111's skip ends the
  current batch and goes on with the next of ``n_iter``; here a request's ``batch_size x
  n_iter`` images run as one batch, so skip stops what interrupt stops (and says ``skipped``).
- ``GET /samplers``, ``/schedulers``: what runs (DDIM, Euler, Euler a, DPM++ 2M, UniPC; Automatic,
  Uniform, Karras: samplers.py; A1111's Normal is refused, not listed), in A1111's shapes.
- ``GET /options``; ``POST /options``: ``CLIP_stop_at_last_layers`` is set for the A1111 routes'
  later requests; ``sd_model_checkpoint`` (the served model's name or title), ``sd_vae`` (its own
  VAE), ``eta_ddim`` (0) and ``samples_format`` (png) are accepted as they are; any other
  value or key 400 naming it.
- ``GET /sd-vae``, ``/memory`` (the process's RSS, the host's RAM, from /proc and ``resource``).
  Listings of what edit-rt has none of (scripts, styles, face restorers, embeddings, ...) are
  a1111_unserved.py's table; LoRAs a1111_loras.py's.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any

from fastapi import APIRouter, Body

from ..model.samplers import a1111_samplers, a1111_schedulers
from .http_errors import ApiError
from ..serving.job_control import A1111
from ..serving.service import Service
from .a1111_fields import checked_option
from .api import b64, errors
from .dependencies import A1111SettingsDep, ServiceDep


def model_names(service: Service) -> tuple[str, ...]:
    """What names the served model in A1111's settings: its name, or its sd-models title."""
    return (service.model_name, f"{service.model_name} [{service.fingerprint[:10]}]")


# ``override_settings.sd_vae`` naming the tiny decoder: that request's images by it (decoder_choice.py)
TINY_VAE_NAME = "taesd"


def vae_names(service: Service, tiny: bool = False) -> tuple[str, ...]:
    """A1111's names for "the model's own VAE" (``Automatic``, ``None``) and its sd-vae entry;
    ``tiny``: with the tiny decoder's (a request's ``override_settings.sd_vae`` may name it)."""
    return ("Automatic", "None", f"{service.model_name}/vae") + ((TINY_VAE_NAME,) if tiny else ())


router = APIRouter()


@router.get("/progress", responses=errors(400, 401), summary="The step loops' progress (A1111's)")
async def progress(service: ServiceDep, settings: A1111SettingsDep, skip_current_image: bool = False):
    now = await service.job_status(A1111)  # this door's jobs only, never another door's
    rows = await service.progress(A1111)  # its rows too: with Ray Serve, the replicas'
    jobs = now["running"] + now["queued"]
    fraction = now["done"] / now["total"] if now["total"] else 0.0
    elapsed = time.monotonic() - now["started"] if now["started"] is not None else 0.0
    eta = elapsed / fraction - elapsed if fraction > 0 else 0.0
    step, of = now["current"] or (0, 0)
    preview = service.previews.last
    stopped = jobs > 0 and now["started"] is not None and service.jobs.interrupted_at >= now["started"]
    return {"progress": round(fraction, 6), "eta_relative": round(eta, 3),
            "current_image": b64(preview) if preview and jobs and not skip_current_image else None,
            "textinfo": f"{now['running']} requests running, {now['queued']} queued ({rows['active']} rows "
                        f"in slots, {rows['queued']} rows queued)" if jobs else None,
            "current_task": None,
            "state": {"skipped": stopped and settings.last_stop == "skip",
                      "interrupted": stopped and settings.last_stop == "interrupt", "stopping_generation": False,
                      "job": "edit-rt" if jobs else "", "job_count": jobs, "job_timestamp": time.strftime("%Y%m%d%H%M%S"),
                      "job_no": 0, "sampling_step": step, "sampling_steps": of}}  # fmt: skip


@router.post("/interrupt", responses=errors(401), summary="Stop the requests running now")
async def interrupt(service: ServiceDep, settings: A1111SettingsDep):
    settings.last_stop = "interrupt"
    return {"interrupted": await service.stop_jobs(A1111)}


@router.post("/skip", responses=errors(401), summary="As interrupt (a request's images run as one batch)")
async def skip(service: ServiceDep, settings: A1111SettingsDep):
    settings.last_stop = "skip"
    return {"skipped": await service.stop_jobs(A1111)}


@router.get("/samplers", responses=errors(401), summary="The samplers that run")
async def samplers():
    return a1111_samplers()


@router.get("/schedulers", responses=errors(401), summary="The schedulers that run")
async def schedulers():
    return a1111_schedulers()


@router.get("/options", responses=errors(401), summary="Settings")
async def get_options(service: ServiceDep, settings: A1111SettingsDep):
    base = service.cfg.base
    stop = settings.clip_stop if settings.clip_stop is not None else base.clip_skip + 1
    return {"sd_model_checkpoint": service.model_name, "sd_checkpoint_hash": service.fingerprint, "sd_vae": "Automatic",
            "samples_format": "png", "CLIP_stop_at_last_layers": stop, "eta_ddim": 0.0,
            "edit_rt_default_steps": base.steps, "edit_rt_size": f"{base.width}x{base.height}"}  # fmt: skip


@router.post("/options", responses=errors(400, 401), summary="Set what this server can set")
async def set_options(service: ServiceDep, settings: A1111SettingsDep, body: dict[str, Any] = Body(...)):
    names, vaes = model_names(service), vae_names(service)
    checked = {key: checked_option(key, value, names, vaes, key) for key, value in body.items()}  # all or nothing
    if "CLIP_stop_at_last_layers" in checked:
        stop = checked["CLIP_stop_at_last_layers"]
        if stop - 1 >= service.fields.family["clip_skips"]:
            raise ApiError(400, f"CLIP_stop_at_last_layers: at most {service.fields.family['clip_skips']} for this model's "
                           "text encoder", param="CLIP_stop_at_last_layers", code="out_of_range")  # fmt: skip
        settings.clip_stop = stop
    return None


@router.get("/sd-vae", responses=errors(401), summary="The served model's own VAE")
async def sd_vae(service: ServiceDep):
    return [{"model_name": vae_names(service)[-1], "filename": str(service.cfg.model_dir / "vae")}]


@router.get("/memory", responses=errors(401), summary="This process's memory")
async def memory(service: ServiceDep):
    return memory_report(service.backend)


def memory_report(backend: str) -> dict[str, Any]:
    """A1111's ``/memory`` shape: ``ram`` {free, used, total} with ``used`` this process's
    resident set (A1111's psutil reading; here /proc/self/status, or ``resource``'s peak where
    there is no /proc), ``total`` the host's; ``cuda`` an error (no CUDA allocator to read)."""
    meminfo = _proc_kb("/proc/meminfo")
    rss = _proc_kb("/proc/self/status").get("VmRSS")
    if rss is None:  # no /proc: the peak, in KiB on Linux and bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss = peak if sys.platform != "darwin" else peak / 1024
    used = int(rss * 1024)
    total = int(meminfo.get("MemTotal", 0) * 1024) or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = int(meminfo.get("MemAvailable", 0) * 1024)
    return {"ram": {"free": total - used, "used": used, "total": total, "available": available},
            "cuda": {"error": f"not reported: the {backend or 'engine'} backend's memory has no CUDA allocator to read"}}  # fmt: skip


def _proc_kb(path: str) -> dict[str, float]:
    """``Key: 123 kB`` lines of a /proc file as {key: KiB} (empty where there is none)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = float(parts[0])
    return out
