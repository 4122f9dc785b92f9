"""The samplers edit-rt runs, by name: their schedules for a model, and A1111's names for them.

Every deterministic solver here is linear in the current VP latent and the last x0 predictions,
so the ``unet_step`` graph runs them all with one update (``COEFS``, ``Schedule``: see
``step_coefs``); an ancestral one adds a per-step normal latent. One file per algorithm
computes its timesteps, alphas and coefficients exactly as diffusers 0.42.1's scheduler does:

    ddim                          scheduler_ddim.py   DDIMScheduler (eta 0)
    euler, euler_karras           sampler_euler.py    EulerDiscreteScheduler (s_churn 0)
    euler_a                       sampler_euler.py    EulerAncestralDiscreteScheduler
    dpmpp_2m, dpmpp_2m_karras     sampler_dpmpp.py    DPMSolverMultistepScheduler (dpmsolver++, 2)
    unipc, unipc_karras           sampler_unipc.py    UniPCMultistepScheduler (bh2, 2, corrector)
    lcm                           sampler_lcm.py      LCMScheduler
    tcd                           sampler_tcd.py      TCDScheduler (gamma = eta 0.3)

The few-step models run with these too: LCM and TCD models (and LCM-LoRA) with ``lcm`` / ``tcd``,
Turbo models with ``euler_a`` (or ``euler``) on their own ``timestep_spacing: trailing``.

``schedule_for(name, scheduler_config, steps)`` means ``Target.from_config(scheduler_config,
**what the name fixes)``: the model's betas, prediction type, spacing and offset carry over.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

from ..errors import ModelError, SamplerError
from .sampler_dpmpp import DPM_DEFAULTS, DPMSolverPPSchedule
from .sampler_euler import EULER_A_DEFAULTS, EULER_DEFAULTS, EulerSchedule
from .sampler_lcm import LCM_DEFAULTS, LCMSchedule
from .sampler_sigmas import read_config
from .sampler_tcd import TCD_DEFAULTS, TCDSchedule
from .sampler_unipc import UNIPC_DEFAULTS, UniPCSchedule
from .scheduler_ddim import DDIMConfig, DDIMSchedule
from .step_coefs import Schedule
from .training_chain import trained_betas_refusal

__all__ = ["IMAGE_SAMPLER", "SAMPLER_NAMES", "SamplerError", "a1111_label", "a1111_sampler", "a1111_samplers",
           "a1111_schedulers", "check_sampler", "default_sampler", "parse_sampler", "schedule_for"]  # fmt: skip

log = logging.getLogger(__name__)

SAMPLER_NAMES = ("ddim", "euler", "euler_karras", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "unipc", "unipc_karras",
                 "lcm", "tcd")

# The sampler of a base from an image, and so of its edits: the image is inverted by running
# DDIM's deterministic update backwards (pipeline.invert), and an edit re-enters its base's chain
# with the base's sampler.
IMAGE_SAMPLER = "ddim"


# name -> (diffusers class, its __init__ defaults, what the name fixes)
_TARGETS: dict = {
    "ddim": ("DDIMScheduler", None, {}),
    "euler": ("EulerDiscreteScheduler", EULER_DEFAULTS, dict(use_karras_sigmas=False)),
    "euler_karras": ("EulerDiscreteScheduler", EULER_DEFAULTS, dict(use_karras_sigmas=True)),
    "euler_a": ("EulerAncestralDiscreteScheduler", EULER_A_DEFAULTS, {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", DPM_DEFAULTS,
                 dict(algorithm_type="dpmsolver++", solver_order=2, use_karras_sigmas=False)),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler", DPM_DEFAULTS,
                        dict(algorithm_type="dpmsolver++", solver_order=2, use_karras_sigmas=True)),
    "unipc": ("UniPCMultistepScheduler", UNIPC_DEFAULTS,
              dict(solver_type="bh2", predict_x0=True, solver_order=2, disable_corrector=[], solver_p=None,
                   use_karras_sigmas=False)),
    "unipc_karras": ("UniPCMultistepScheduler", UNIPC_DEFAULTS,
                     dict(solver_type="bh2", predict_x0=True, solver_order=2, disable_corrector=[], solver_p=None,
                          use_karras_sigmas=True)),
    "lcm": ("LCMScheduler", LCM_DEFAULTS, {}),
    "tcd": ("TCDScheduler", TCD_DEFAULTS, {}),
}  # fmt: skip

# ----------------------------------------------------------------------------- names

# A1111's samplers edit-rt runs: (name, aliases, options as /sdapi/v1/samplers shows them, plain, karras)
_A1111 = [
    ("DDIM", ["ddim"], {}, "ddim", None),
    ("Euler", ["k_euler"], {}, "euler", "euler_karras"),
    ("Euler a", ["k_euler_a", "k_euler_ancestral"], {"uses_ensd": "True"}, "euler_a", None),
    ("DPM++ 2M", ["k_dpmpp_2m"], {"scheduler": "karras"}, "dpmpp_2m", "dpmpp_2m_karras"),
    ("UniPC", ["unipc"], {}, "unipc", "unipc_karras"),
    ("LCM", ["lcm"], {}, "lcm", None),
    ("TCD", ["tcd"], {}, "tcd", None),  # not A1111's own: Forge's name for it
]
# A1111's samplers edit-rt does not run (refused by name)
_A1111_OTHER = ("LMS", "Heun", "DPM2", "DPM2 a", "DPM++ 2S a", "DPM++ SDE", "DPM++ 2M SDE", "DPM++ 2M SDE Heun",
                "DPM++ 3M SDE", "DPM fast", "DPM adaptive", "Restart", "DDIM CFG++", "PLMS", "LMS Karras",
                "Heun Karras", "DPM2 Karras", "DPM2 a Karras", "DPM++ 2S a Karras", "DPM++ SDE Karras")  # fmt: skip
# A1111's schedulers (sd_schedulers.py): name, label, aliases, default_rho, need_inner_model
_SCHEDULERS = [
    ("automatic", "Automatic", None, -1, False),
    ("uniform", "Uniform", None, -1, True),
    ("karras", "Karras", None, 7.0, False),
    ("exponential", "Exponential", None, -1, False),
    ("polyexponential", "Polyexponential", None, 1.0, False),
    ("sgm_uniform", "SGM Uniform", ["SGMUniform"], -1, True),
    ("kl_optimal", "KL Optimal", None, -1, False),
    ("align_your_steps", "Align Your Steps", None, -1, False),
    ("simple", "Simple", None, -1, True),
    ("normal", "Normal", None, -1, True),
    ("ddim", "DDIM", None, -1, True),
    ("beta", "Beta", None, -1, True),
]
# What runs: the sampler's own default, the model's own spacing (diffusers' timestep_spacing), and
# Karras sigmas. A1111's Normal (sd_schedulers.normal_scheduler: n timesteps evenly from
# sigma_to_t(sigma_max) to 0, each sigma interpolated in log-sigma, k-diffusion's) is another
# schedule than the model config's spacing on most models (SD 1.5: "leading", steps_offset 1), so
# it is refused by name rather than run as Uniform under Normal's name.
_RUN_SCHEDULERS = ("automatic", "uniform", "karras")
_NOT_RUN = {
    "normal": "A1111's Normal: n timesteps evenly from the model's last to 0, sigmas interpolated in log-sigma "
              "as k-diffusion does; no sampler here runs that schedule",
}  # fmt: skip

_NAMES = {n: n for n in SAMPLER_NAMES}
_NAMES.update({
    "ddim": "ddim", "euler": "euler", "euler a": "euler_a", "euler karras": "euler_karras",
    "dpm++ 2m": "dpmpp_2m", "dpm++ 2m karras": "dpmpp_2m_karras", "unipc": "unipc", "unipc karras": "unipc_karras",
    "k_euler": "euler", "k_euler_a": "euler_a", "k_euler_ancestral": "euler_a", "k_dpmpp_2m": "dpmpp_2m",
    "k_dpmpp_2m_ka": "dpmpp_2m_karras",
    "ddimscheduler": "ddim", "eulerdiscretescheduler": "euler", "eulerancestraldiscretescheduler": "euler_a",
    "dpmsolvermultistepscheduler": "dpmpp_2m", "unipcmultistepscheduler": "unipc",
    "lcmscheduler": "lcm", "tcdscheduler": "tcd",
})  # fmt: skip


def _accepted() -> str:
    return (", ".join(SAMPLER_NAMES) + " (A1111: " + ", ".join(a[0] for a in _A1111) + ", DPM++ 2M Karras, "
            "Euler Karras, UniPC Karras)")  # fmt: skip


def parse_sampler(name: str, field: str = "sampler") -> str:
    """The canonical sampler of ``name``: canonical, A1111's, k-diffusion's or diffusers' class name."""
    if not isinstance(name, str) or name.strip().lower() not in _NAMES:
        raise SamplerError(field, f"unknown sampler {name!r}; edit-rt runs: {_accepted()}")
    return _NAMES[name.strip().lower()]


def _scheduler_row(label: str):
    key = label.strip().lower()
    for row in _SCHEDULERS:
        if key in (row[0], row[1].lower(), *(a.lower() for a in row[2] or ())):
            return row
    return None


def _run_schedulers() -> str:
    return ", ".join(r[1] for r in _SCHEDULERS if r[0] in _RUN_SCHEDULERS)


def _not_run(row, label: str) -> str:
    """Why scheduler ``label`` (its ``_SCHEDULERS`` row, or None: unknown) is refused, and what runs."""
    why = f" ({_NOT_RUN[row[0]]})" if row is not None and row[0] in _NOT_RUN else ""
    return f"scheduler {label!r} does not run in edit-rt{why}; it runs: {_run_schedulers()}"


def a1111_sampler(sampler_name: Optional[str], scheduler: Optional[str],
                  field: str = "sampler_name") -> Optional[str]:  # fmt: skip
    """A1111's (sampler_name, scheduler) as a canonical sampler; (None, None): None (the default).

    As A1111 (>= 1.9) reads them: a scheduler label at the end of the sampler's name ("DPM++ 2M
    Karras") sets the scheduler; "Automatic" is the sampler's own default (Karras for DPM++ 2M);
    "Uniform" keeps the model's own spacing; "Normal" and the rest are refused (``_NOT_RUN``).
    """
    sched_field = "scheduler"
    row = _scheduler_row(scheduler) if scheduler not in (None, "") else _SCHEDULERS[0]
    if row is None or row[0] not in _RUN_SCHEDULERS:
        raise SamplerError(sched_field, _not_run(row, scheduler))
    if sampler_name in (None, ""):
        if row[0] != "automatic":
            raise SamplerError(sched_field, f"scheduler {scheduler!r} needs a sampler_name")
        return None
    name = sampler_name.strip()
    # a scheduler named at the end of the sampler's name wins, as A1111's get_sampler_and_scheduler
    for r in _SCHEDULERS:
        hit = next((o for o in (r[1], r[0], *(r[2] or ())) if name.lower().endswith(" " + o.lower())), None)
        if hit is not None:
            if r[0] not in _RUN_SCHEDULERS:
                raise SamplerError(field, f"{sampler_name!r}: {_not_run(r, r[1])}")
            row, sched_field, name = r, field, name[: -len(hit) - 1].strip()
            break
    base = next((a for a in _A1111 if name.lower() in (a[0].lower(), *(x.lower() for x in a[1]))), None)
    if base is None:
        if name.lower() == "k_dpmpp_2m_ka":
            base, row = _A1111[3], _SCHEDULERS[2]
        elif name.lower() in _NAMES and name.lower() not in ("ddimscheduler",):
            canon = _NAMES[name.lower()]
            base = next(a for a in _A1111 if canon in (a[3], a[4]))
            if canon == base[4] and row[0] == "automatic":
                row = _SCHEDULERS[2]
        elif any(name.lower() == o.lower() for o in _A1111_OTHER):
            raise SamplerError(field, f"A1111 sampler {sampler_name!r} does not run in edit-rt; it runs: "
                                      + ", ".join(a[0] for a in _A1111))  # fmt: skip
        else:
            raise SamplerError(field, f"unknown sampler {sampler_name!r}; edit-rt runs: "
                                      + ", ".join(a[0] for a in _A1111))  # fmt: skip
    karras = row[0] == "karras" or (row[0] == "automatic" and base[2].get("scheduler") == "karras")
    if not karras:
        return base[3]
    if base[4] is None:
        raise SamplerError(sched_field, f"{base[0]} runs without the Karras schedule in edit-rt; "
                                        "take scheduler Automatic or Uniform")  # fmt: skip
    return base[4]


def a1111_samplers() -> list:
    """``/sdapi/v1/samplers``: the A1111 samplers edit-rt runs."""
    return [{"name": a[0], "aliases": list(a[1]), "options": dict(a[2])} for a in _A1111]


def a1111_schedulers() -> list:
    """``/sdapi/v1/schedulers``: the A1111 schedulers edit-rt accepts."""
    return [{"name": r[0], "label": r[1], "aliases": r[2], "default_rho": r[3], "need_inner_model": r[4]}
            for r in _SCHEDULERS if r[0] in _RUN_SCHEDULERS]  # fmt: skip


def a1111_label(name: str) -> tuple:
    """A canonical sampler as A1111's (sampler_name, scheduler label): what the PNG info says."""
    name = parse_sampler(name)
    for a in _A1111:
        if name == a[4]:
            return a[0], "Karras"
        if name == a[3]:
            # Automatic is Karras for DPM++ 2M: its plain spacing is "Uniform" there
            return a[0], "Uniform" if a[2].get("scheduler") == "karras" else "Automatic"
    raise AssertionError(name)


# ----------------------------------------------------------------------------- configs


def _resolved(name: str, cfg: Mapping[str, Any]) -> dict:
    cls, defaults, overrides = _TARGETS[name]
    c = read_config(defaults, cfg, **overrides)
    if cls == "DPMSolverMultistepScheduler" and c["solver_type"] in ("logrho", "bh1", "bh2"):
        c["solver_type"] = "midpoint"  # as DPMSolverMultistepScheduler.__init__ re-registers it
    return c


def _ddim_config(cfg: Mapping[str, Any]) -> DDIMConfig:
    used_defaults = set(cfg.get("_use_default_values") or ())
    return DDIMConfig.from_scheduler_config({k: v for k, v in cfg.items() if k not in used_defaults})


_PREDICTIONS = {
    "ddim": ("epsilon", "v_prediction", "sample"),
    "EulerDiscreteScheduler": ("epsilon", "v_prediction", "sample", "original_sample"),
    "EulerAncestralDiscreteScheduler": ("epsilon", "v_prediction"),
    "DPMSolverMultistepScheduler": ("epsilon", "v_prediction", "sample"),
    "UniPCMultistepScheduler": ("epsilon", "v_prediction", "sample"),
    "LCMScheduler": ("epsilon", "v_prediction", "sample"),
    "TCDScheduler": ("epsilon", "v_prediction", "sample"),
}
# options a target takes that edit-rt does not run: option -> the value that runs
_OFF = {
    "EulerDiscreteScheduler": dict(use_exponential_sigmas=False, use_beta_sigmas=False, rescale_betas_zero_snr=False,
                                   interpolation_type="linear"),
    "EulerAncestralDiscreteScheduler": dict(rescale_betas_zero_snr=False),
    "DPMSolverMultistepScheduler": dict(thresholding=False, use_exponential_sigmas=False, use_beta_sigmas=False,
                                        use_lu_lambdas=False, use_flow_sigmas=False, variance_type=None,
                                        rescale_betas_zero_snr=False, use_dynamic_shifting=False),
    "UniPCMultistepScheduler": dict(thresholding=False, use_exponential_sigmas=False, use_beta_sigmas=False,
                                    use_flow_sigmas=False, rescale_betas_zero_snr=False, use_dynamic_shifting=False,
                                    shift_terminal=None),
    "LCMScheduler": dict(thresholding=False, rescale_betas_zero_snr=False),
    "TCDScheduler": dict(thresholding=False, rescale_betas_zero_snr=False),
}  # fmt: skip


# the consistency samplers: their timesteps come from original_inference_steps, not timestep_spacing
_CONSISTENCY = ("LCMScheduler", "TCDScheduler")


def _problem(name: str, cfg: Mapping[str, Any]) -> Optional[str]:
    """Why ``name`` cannot run on ``cfg`` (a message naming the option), or None."""
    cls = _TARGETS[name][0]
    if name == "ddim":
        try:
            c = _ddim_config(cfg)
            DDIMSchedule(c, 1)
        except (ModelError, TypeError) as e:
            return str(e).removeprefix("scheduler_config.json: ")
        if c.prediction_type not in _PREDICTIONS["ddim"]:
            return f"prediction_type {c.prediction_type!r} is not one of {', '.join(_PREDICTIONS['ddim'])} (DDIM)"
        return None
    c = _resolved(name, cfg)
    why = trained_betas_refusal(c)
    if why is not None:
        return why
    if c["beta_schedule"] not in ("linear", "scaled_linear", "squaredcos_cap_v2"):
        return f"beta_schedule {c['beta_schedule']!r} is not supported by {cls}"
    if c["prediction_type"] not in _PREDICTIONS[cls]:
        return f"prediction_type {c['prediction_type']!r} is not one of {', '.join(_PREDICTIONS[cls])} ({cls})"
    if c["timestep_spacing"] not in ("linspace", "leading", "trailing") and cls not in _CONSISTENCY:
        return f"timestep_spacing {c['timestep_spacing']!r} is not one of linspace, leading, trailing"
    for key, ok in _OFF[cls].items():
        if c[key] != ok and not (ok is False and not c[key]):
            return f"{key}={c[key]!r} is not supported by edit-rt's {name} ({cls})"
    if c.get("final_sigmas_type", "zero") not in ("zero", "sigma_min"):
        return f"final_sigmas_type {c['final_sigmas_type']!r} is not one of zero, sigma_min"
    if cls == "EulerDiscreteScheduler" and c["timestep_type"] not in ("discrete", "continuous"):
        return f"timestep_type {c['timestep_type']!r} is not one of discrete, continuous"
    if cls == "DPMSolverMultistepScheduler" and c["solver_type"] not in ("midpoint", "heun"):
        return f"solver_type {c['solver_type']!r} is not one of midpoint, heun (DPMSolverMultistepScheduler)"
    if name in ("dpmpp_2m_karras", "unipc_karras") and c["beta_schedule"] == "squaredcos_cap_v2":
        return ("use_karras_sigmas with beta_schedule squaredcos_cap_v2: the integer Karras timesteps repeat "
                "(sigma_max ~2e4), where diffusers' step lookup fails")  # fmt: skip
    if cls == "UniPCMultistepScheduler" and not c["lower_order_final"] and c["final_sigmas_type"] == "zero":
        return ("lower_order_final=false with final_sigmas_type zero: UniPC's last second-order step divides by "
                "zero there (diffusers returns inf/nan)")  # fmt: skip
    return None


def check_sampler(name: str, scheduler_config: Mapping, field: str = "sampler") -> None:
    """Refuses (``SamplerError`` naming ``field``) a sampler this model's config cannot run."""
    if name not in _TARGETS:
        raise SamplerError(field, f"unknown sampler {name!r}; edit-rt runs: {_accepted()}")
    why = _problem(name, scheduler_config)
    if why is not None:
        raise SamplerError(field, f"{name} cannot run on this model: {why}")


def schedule_for(name: str, scheduler_config: Mapping, steps: int) -> Schedule:
    """The schedule of canonical sampler ``name`` at ``steps`` steps for this model's scheduler config.

    As diffusers' ``Target.from_config(scheduler_config, **what the name fixes)``; options edit-rt
    does not run: ``SamplerError(field="scheduler_config")``; bad ``steps``: ``ValueError``.
    """
    if name not in _TARGETS:
        raise SamplerError("sampler", f"unknown sampler {name!r}; edit-rt runs: {_accepted()}")
    why = _problem(name, scheduler_config)
    if why is not None:
        raise SamplerError("scheduler_config", why)
    if not isinstance(steps, int) or isinstance(steps, bool):
        raise ValueError(f"steps={steps!r} must be an integer")
    if name == "ddim":
        return DDIMSchedule(_ddim_config(scheduler_config), steps)
    c = _resolved(name, scheduler_config)
    cls = _TARGETS[name][0]
    if cls == "EulerDiscreteScheduler":
        return EulerSchedule(c, steps, name=name)
    if cls == "EulerAncestralDiscreteScheduler":
        return EulerSchedule(c, steps, ancestral=True, name=name)
    if cls == "LCMScheduler":
        return LCMSchedule(c, steps, name=name)
    if cls == "TCDScheduler":
        return TCDSchedule(c, steps, name=name)
    if cls == "DPMSolverMultistepScheduler":
        return DPMSolverPPSchedule(c, steps, name=name)
    return UniPCSchedule(c, steps, name=name)


def default_sampler(scheduler_config: Mapping) -> str:
    """The canonical sampler a model's ``scheduler_config.json`` names; "ddim" where it names none
    edit-rt runs as that class (PNDM, which Stable Diffusion ships, runs as DDIM)."""
    cls = scheduler_config.get("_class_name")
    name, why = "ddim", None
    if cls in _TARGETS["euler"][0:1] + _TARGETS["euler_a"][0:1] + _TARGETS["dpmpp_2m"][0:1] + _TARGETS["unipc"][0:1]:
        defaults = {"EulerDiscreteScheduler": EULER_DEFAULTS, "EulerAncestralDiscreteScheduler": EULER_A_DEFAULTS,
                    "DPMSolverMultistepScheduler": DPM_DEFAULTS, "UniPCMultistepScheduler": UNIPC_DEFAULTS}[cls]
        c = read_config(defaults, scheduler_config)
        karras = "_karras" if c.get("use_karras_sigmas") else ""
        if cls == "EulerDiscreteScheduler":
            name = "euler" + karras
        elif cls == "EulerAncestralDiscreteScheduler":
            name = "euler_a"
        elif cls == "DPMSolverMultistepScheduler":
            if c["algorithm_type"] != "dpmsolver++" or c["solver_order"] != 2:
                why = (f"edit-rt runs DPMSolverMultistepScheduler as dpmsolver++ order 2 only, not "
                       f"{c['algorithm_type']} order {c['solver_order']}")  # fmt: skip
            else:
                name = "dpmpp_2m" + karras
        else:
            off = {k: c[k] for k, v in dict(solver_type="bh2", predict_x0=True, solver_order=2).items() if c[k] != v}
            if c["disable_corrector"] or c["solver_p"] is not None:
                off.update(disable_corrector=c["disable_corrector"], solver_p=c["solver_p"])
            if off:
                why = f"edit-rt runs UniPCMultistepScheduler as bh2, predict_x0, order 2, corrector on only, not {off}"
            else:
                name = "unipc" + karras
        if why is None:
            why = _problem(name, scheduler_config)
            if why is not None:
                why, name = f"{name}: {why}", "ddim"
        else:
            name = "ddim"
    elif cls in _CONSISTENCY:
        name = {"LCMScheduler": "lcm", "TCDScheduler": "tcd"}[cls]
        why = _problem(name, scheduler_config)
        if why is not None:
            why, name = f"{name}: {why}", "ddim"
    elif cls not in ("DDIMScheduler", None):
        why = f"{cls} runs as DDIM on its betas" if cls == "PNDMScheduler" else f"edit-rt does not run {cls}"
    if why is not None:
        log.info("scheduler_config %s: %s; the default sampler is ddim", cls, why)
    return name
