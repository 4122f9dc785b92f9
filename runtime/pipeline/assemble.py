"""What a run config builds: its pipeline (graphs, backend, profile, size) and its store.

Used by every door: `edit-rt run` (run.py), `edit-rt serve` (service.py), the bench. What it needs
on disk is checked in the order a user can act on it (:func:`require_ready`): the model, then its
export, then the converted adapters; each refusal names the command that makes what is missing.
"""

from __future__ import annotations

from pathlib import Path

from ..config.run_config import RunConfig
from ..engine.manifest import Manifest, model_files, sha256_file
from ..engine.profiles import EditBatchProfile
from ..errors import ArtifactError, ConfigError, ModelError, SamplerError
from ..model.adapters import lora_source
from ..model.samplers import check_sampler
from ..storage.store import BaseStore
from .edit_pipeline import EditPipeline, edit_batch_profile


def store_of(cfg: RunConfig, fingerprint: str) -> BaseStore:
    s = cfg.store
    return BaseStore(fingerprint, int(s.ram_mb * 2**20), s.disk_dir, int(s.disk_mb * 2**20),
                     s.latents_precision, s.kv_precision, s.eviction)  # fmt: skip


def profile_options(cfg: RunConfig) -> dict:
    """The config's fields :func:`edit_batch_profile` reads, as EditPipeline's arguments: the
    engines `edit-rt engines` builds and the pipeline that runs them take the same profile."""
    e = cfg.engines
    return dict(batch_profile=e.batch_rows(), image_size=(cfg.base.height, cfg.base.width),
                extra_image_sizes=[(h, w) for w, h in cfg.served_sizes()[1:]], max_uncond_sets=e.max_uncond_sets,
                vae_max_batch=e.vae_max_batch)  # fmt: skip


def profile_of(cfg: RunConfig, manifest: Manifest) -> EditBatchProfile:
    """The edit-batch profile of the config's engines for the export ``manifest`` describes."""
    return edit_batch_profile(manifest, **profile_options(cfg))


def require_model(cfg: RunConfig) -> None:
    """``model:`` itself: a diffusers folder, refused in one line naming the config and the fix
    when it does not exist or is no diffusers model (a single file's header was read at load).
    A folder with a ``model_index.json`` is the export's to judge: its refusal names the family
    (an SD3 or Flux pipeline, a latent-consistency scheduler) where a list of missing parts would not."""
    if cfg.single_file or (cfg.model / "model_index.json").is_file():
        return
    try:
        model_files(cfg.model)
    except ModelError as err:
        where = f"{cfg.source}: " if cfg.source is not None else ""
        raise ModelError(f"{where}model: {err}") from None


def require_build(cfg: RunConfig) -> Path:
    """The model's diffusers folder once `edit-rt export` has run on it: a single file converted,
    the graphs' manifest written; else one line naming that command."""
    model_dir = cfg.require_model_dir()
    manifest = cfg.onnx_dir / "manifest.json"
    if not manifest.is_file():  # what the manifest holds is load_manifest's to check
        raise ArtifactError(f"{manifest} not found; run `make export` (edit-rt export {cfg.source or 'CONFIG'}) first")
    return model_dir


def require_ready(cfg: RunConfig) -> None:
    """Everything a run needs on disk, in the order a user fixes it: the model, its export, the
    adapters' conversions (an adapter cannot be converted before the export it is converted for)."""
    require_model(cfg)
    require_build(cfg)
    adapter_files(cfg)


def adapter_files(cfg: RunConfig) -> dict[str, Path]:
    """The converted file of each configured adapter (`edit-rt adapters` writes them); one whose
    source changed since is refused, naming the command that converts it again."""
    from ..model.adapters import adapter_path

    files = {}
    for name, source in cfg.adapters.items():
        path = adapter_path(cfg.adapters_dir, name)
        if not source.exists():
            raise ConfigError(f"adapters.{name}: {source} not found; fix the path")
        if not path.is_file():
            raise ArtifactError(f"adapters.{name}: not converted for this model yet; run `edit-rt adapters {cfg.source or 'CONFIG'}`")
        files[name] = path
    return files


def pipeline_of(cfg: RunConfig, **overrides) -> EditPipeline:
    """The config's pipeline (not activated): its graphs, backend, profile and image size."""
    e = cfg.engines
    options = dict(
        threads=cfg.threads, backend=cfg.backend, engines_dir=cfg.engines_dir, **profile_options(cfg), cuda_graphs=e.cuda_graphs,
        precision=e.precision, buckets=e.buckets, max_memory=None if e.max_memory_gb is None else int(e.max_memory_gb * 1e9),
        preserve=cfg.preserve,
    )  # fmt: skip
    require_model(cfg)
    model_dir = require_build(cfg)
    options["adapters"] = adapter_files(cfg)
    pipe = EditPipeline(cfg.onnx_dir, model_dir, **(options | overrides))
    for name, adapter in (pipe.adapter_bank.adapters if pipe.adapter_bank else {}).items():
        if name in cfg.adapters and sha256_file(lora_source(cfg.adapters[name])) != adapter.source_sha256:
            raise ArtifactError(f"adapters.{name}: {cfg.adapters[name]} changed since it was converted; run "
                                f"`edit-rt adapters {cfg.source or 'CONFIG'}`")  # fmt: skip
    exported = pipe.manifest.data["model"].get("variant")
    if exported != cfg.export.variant:  # the same folder, other weights files
        raise ArtifactError(f"{cfg.onnx_dir} was exported from the {exported or 'default'} weights and export.variant "
                            f"is {cfg.export.variant!r}; re-run `make export` (edit-rt export CONFIG)")  # fmt: skip
    skips = pipe.family["clip_skips"]
    if cfg.base.clip_skip >= skips:
        raise ConfigError(f"base.clip_skip: {cfg.base.clip_skip} is outside [0, {skips - 1}] for this model's text encoder")
    if cfg.base.sampler is not None:  # a name edit-rt does not know is refused when the config is read
        try:
            check_sampler(cfg.base.sampler, pipe.manifest.scheduler_config, "base.sampler")
        except SamplerError as err:
            raise ConfigError(str(err)) from None
    if not any(c["source"] == "time_ids" for c in pipe.text.conds):
        for name in ("original_width", "original_height"):
            if getattr(cfg.base, name) is not None:
                raise ConfigError(f"base.{name}: only SDXL models take size conditioning; remove it")
    return pipe
