"""A run config file read into a :class:`~edit_rt.runtime.config.run_config.RunConfig`: YAML
(a key given twice refused), validated by pydantic against the declarations in run_config.py,
every refusal worded as one :class:`ConfigError` naming the file, the field path
(``edits[2].strength``) and the fix; paths taken from the file's folder; the base's speed LoRA's
schedule set where the base sets none; sweeps expanded into their rows, a catalogue's size counted;
a plan's base made from its ``plan:`` section. A text config (``text:``, config/text.py) is read by
:func:`load_text_config`."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import TypeAdapter, ValidationError

from ..errors import ConfigError
from ..model import driving
from ..model.adapters import SCHEDULE_FIELDS
from ..model.lora_tags import config_with_tags
from ..model.plan_grid import HEIGHT, WIDTH
from ..model.samplers import IMAGE_SAMPLER
from ..model.schema import refusal
from ..model.single_file import checkpoint_family
from ..model.sweep import expand_all, rows_of
from .catalogue import MAX_ROWS, Catalogue
from .run_config import RunConfig
from .text import TextRunConfig


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if _is_tag(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _type_at(loc: tuple, root: Any = RunConfig) -> Any:
    """The dataclass a location's last key belongs to (for the list of allowed keys)."""
    tp: Any = root
    for part in loc:
        if isinstance(part, int) or _is_tag(part):  # a list's item; a union's branch, chosen below
            continue
        if typing.get_origin(tp) is dict:  # a mapping's key: its values' type
            tp = typing.get_args(tp)[1]
        else:
            tp = typing.get_type_hints(tp, include_extras=False).get(part)
        while typing.get_origin(tp) in (list, tuple, Optional, types.UnionType, typing.Union):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = next((a for a in args if dataclasses.is_dataclass(a)), args[0])
        if not dataclasses.is_dataclass(tp) and typing.get_origin(tp) is not dict:
            return None
    return tp if dataclasses.is_dataclass(tp) else None


def _is_tag(part: Any) -> bool:
    """A union's branch tag in a location (run_config.AdapterEntry's), not a key: no key starts with "("."""
    return isinstance(part, str) and part.startswith("(")


def _config_error(err: ValidationError, root: Any = RunConfig) -> ConfigError:
    first = err.errors()[0]
    loc, kind = tuple(first["loc"]), first["type"]
    where = _path(loc) or "top level"
    if kind == "unexpected_keyword_argument":
        owner = _type_at(loc[:-1], root)
        known = sorted(f.name for f in dataclasses.fields(owner) if f.name not in _SET_AT_LOAD) if owner else []
        return ConfigError(f"{where}: unknown key; the keys allowed here are {', '.join(known)}")
    if kind in ("missing", "missing_argument", "missing_keyword_argument"):
        return ConfigError(f"{where}: missing; this field is required")
    if any(_is_tag(part) for part in loc) and _type_at(loc[:-1], root) is not None:  # a range from inside a union's branch
        return ConfigError(f"{where}: {refusal({**first, 'loc': loc[-1:]}, _type_at(loc[:-1], root))}")
    return ConfigError(f"{where}: {refusal(first, root)}")


_ADAPTER: Optional[TypeAdapter] = None


_SET_AT_LOAD = {"source": "from the file's path", "edit_rows": "from the edits' sweeps",
               "speed_adapters": "from adapters: entries written as {path, sampler, steps, guidance}",
               "base_schedule_filled": "from the base's speed LoRA"}  # fmt: skip


def config_from_dict(data: Any, source: Optional[Path] = None) -> RunConfig:
    """Build and validate a RunConfig; relative paths are taken from ``source``'s folder."""
    global _ADAPTER
    label = f"{source}: " if source is not None else ""
    try:
        if not isinstance(data, dict):
            raise ConfigError(f"top level: must be a mapping, got {type(data).__name__}")
        for key in _SET_AT_LOAD:
            if key in data:
                raise ConfigError(f"{key}: unknown key; it is set at load ({_SET_AT_LOAD[key]})")
        if _ADAPTER is None:
            _ADAPTER = TypeAdapter(RunConfig)
        if "plan" in data:  # a plan's base: its chain from base:, its prompt and size the plan's (plan.py)
            data = {**data, "base": plan_base(data.get("base", {}))}
        data, base_tags = config_with_tags(data)  # <lora:name:w> in base.prompt, edits[i].prompt: their adapters
        try:
            cfg = _ADAPTER.validate_python(data)
        except ValidationError as err:
            raise _config_error(err) from None
        if cfg.plan is not None:
            v = cfg.plan
            prompt = driving.prompt(v.the_scene(), v.base_behaviour, v.base_aggressiveness)
            cfg = dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, prompt=prompt))
        if base_tags:  # a base may take A1111's (te, unet) apart, which base.adapters' scale cannot say
            cfg = dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, adapters={**(cfg.base.adapters or {}), **base_tags}))
        # a speed LoRA's schedule where the file's base sets none of its own
        set_here = {f for f in SCHEDULE_FIELDS if f in data["base"]} if isinstance(data["base"], dict) else set(SCHEDULE_FIELDS)
        scheduled = cfg.scheduled(cfg.base, set_here)
        if scheduled != cfg.base:
            filled = tuple(f for f in SCHEDULE_FIELDS if getattr(scheduled, f) != getattr(cfg.base, f))
            cfg = dataclasses.replace(cfg, base=scheduled, base_schedule_filled=filled)
        root = source.parent if source is not None else Path.cwd()
        cfg = dataclasses.replace(
            cfg,
            model=_resolve(cfg.model, root),
            build_dir=_resolve(cfg.build_dir, root),
            output_dir=_resolve(cfg.output_dir, root),
            adapters={name: _resolve(path, root) for name, path in cfg.adapters.items()},
            speed_adapters={name: dataclasses.replace(s, path=_resolve(s.path, root)) for name, s in cfg.speed_adapters.items()},
            checkpoint_config=None if cfg.checkpoint_config is None else _resolve(cfg.checkpoint_config, root),
            source=source,
        )
        check_adapter_names(cfg)  # with the file's own indices, before sweeps expand them
        if any(edit.sweep is not None for edit in cfg.edits):  # a sweep runs as its rows (model/sweep.py)
            try:
                cfg = dataclasses.replace(cfg, edits=expand_all(cfg.edits), edit_rows=tuple(rows_of([e]) for e in cfg.edits))
            except ValueError as err:
                raise ConfigError(str(err)) from None
        if cfg.catalogue is not None:
            check_catalogue(cfg.catalogue)
        if cfg.export.tiny_vae is not None:
            cfg = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, tiny_vae=_resolve(cfg.export.tiny_vae, root)))
        if cfg.store.disk_dir is not None:
            cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, disk_dir=_resolve(cfg.store.disk_dir, root)))
        if cfg.base.image is not None:
            cfg = dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, image=str(_resolve(Path(cfg.base.image), root))))
        cfg.validate("")
        if cfg.single_file and cfg.family is None:  # validate() refused what it cannot detect
            cfg = dataclasses.replace(cfg, family=checkpoint_family(cfg.model))
    except ConfigError as err:
        raise ConfigError(f"{label}{err}") from None
    return cfg


def plan_base(given: Any) -> dict:
    """A plan config's ``base:``: what it may set (seed, steps, guidance), over the plan's defaults."""
    if not isinstance(given, dict):
        raise ConfigError(f"base: must be a mapping (seed, steps, guidance), got {type(given).__name__}")
    for key in given:
        if key not in ("seed", "steps", "guidance"):
            raise ConfigError(f"base.{key}: a plan's base sets seed, steps and guidance only; its prompt is the scene's and "
                              "base behaviour's words (plan:), its size the plan grid's; remove it")  # fmt: skip
    return {"prompt": "plan", "negative_prompt": "", "width": WIDTH, "height": HEIGHT, "sampler": IMAGE_SAMPLER,
            "steps": 20, "guidance": 3.0, **given}  # fmt: skip


def check_catalogue(spec: Catalogue) -> None:
    """Its size against its limit, counted before any row is made, and what its rows could
    only refuse one by one: a slider naming a direction an edit lacks, an edit's own sweep."""
    rows = spec.size()
    if rows > spec.max_rows:
        sliders = sum(s.n for s in spec.sliders)
        raise ConfigError(f"catalogue: {len(spec.edits)} edits x {max(1, sliders)} slider positions = {rows} rows, more than "
                          f"catalogue.max_rows={spec.max_rows}; raise it (up to {MAX_ROWS}) or ask for fewer")  # fmt: skip
    for i, edit in enumerate(spec.edits):
        if edit.sweep is not None:
            raise ConfigError(f"catalogue.edits[{i}].sweep: a catalogue sweeps its sliders; move it to catalogue.sliders")
        for j, slider in enumerate(spec.sliders):
            if slider.direction is not None and slider.direction >= len(edit.directions or ()):
                raise ConfigError(f"catalogue.sliders[{j}].direction: {slider.direction} names no direction of "
                                  f"catalogue.edits[{i}] (it has {len(edit.directions or ())})")  # fmt: skip


def check_adapter_names(cfg: RunConfig) -> None:
    """Every adapter a config names (a row's ``adapters:``, a sweep's or a slider's ``adapter``) is
    one of its ``adapters:``: refused at load, naming the field, not when the row's tail reaches it."""
    uses: list[tuple[str, Optional[str]]] = [(f"base.adapters.{n}", n) for n in cfg.base.adapters or {}]
    catalogue = cfg.catalogue.edits if cfg.catalogue is not None else []
    for where, edits in (("edits", cfg.edits), ("catalogue.edits", catalogue)):
        for i, edit in enumerate(edits):
            uses += [(f"{where}[{i}].adapters.{n}", n) for n in edit.adapters or {}]
            uses.append((f"{where}[{i}].sweep.adapter", edit.sweep.adapter if edit.sweep is not None else None))
    for j, slider in enumerate(cfg.catalogue.sliders if cfg.catalogue is not None else []):
        uses.append((f"catalogue.sliders[{j}].adapter", slider.adapter))
    for where, name in uses:
        if name is not None and name not in cfg.adapters:
            have = ", ".join(sorted(cfg.adapters)) or "none"
            raise ConfigError(f"{where}: {name!r} is not one of this config's adapters: (it has: {have}); add "
                              f"`{name}: path/to/lora.safetensors` under adapters:, or name one of those")  # fmt: skip


def revalidated(section: Any, where: str) -> Any:
    """``section`` (a config dataclass changed in code, e.g. by the CLI's --port) checked
    against its declared bounds again; a ConfigError that names ``where`` and the field."""
    try:
        return TypeAdapter(type(section)).validate_python(dataclasses.asdict(section))
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(f"{where}: {_path(tuple(first['loc']))}: {refusal(first, type(section))}") from None


def load_config(path: Path | str) -> RunConfig:
    """Read a YAML config file into a validated :class:`RunConfig`."""
    data = _yaml_of(Path(path))
    if isinstance(data, dict) and "text" in data:
        raise ConfigError(f"{path}: a text config (text:); `edit-rt export` and `edit-rt run` take it, this command "
                          "runs image and plan configs")  # fmt: skip
    return config_from_dict(data, source=Path(path))


def is_text_config(path: Path | str) -> bool:
    """Whether the file is a text config (``text:`` at its top level)."""
    data = _yaml_of(Path(path))
    return isinstance(data, dict) and "text" in data


def load_text_config(path: Path | str) -> TextRunConfig:
    """Read a text config file into a validated :class:`TextRunConfig` (paths from its folder)."""
    path = Path(path)
    data = _yaml_of(path)
    try:
        if not isinstance(data, dict):
            raise ConfigError(f"top level: must be a mapping, got {type(data).__name__}")
        if "source" in data:
            raise ConfigError("source: unknown key; it is set at load (from the file's path)")
        try:
            cfg = TypeAdapter(TextRunConfig).validate_python(data)
        except ValidationError as err:
            raise _config_error(err, TextRunConfig) from None
        root = path.parent
        cfg = dataclasses.replace(cfg, model=_resolve(cfg.model, root), build_dir=_resolve(cfg.build_dir, root),
                                  output_dir=_resolve(cfg.output_dir, root), source=path).validate()  # fmt: skip
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    return cfg


def _yaml_of(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); save the file as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}:{where}: {err.problem or err.context} (fix the YAML there)") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    silently: a second ``base:`` would replace the first one whole)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice (lines {seen[key]} and {line}); keep one",
                        key_node.start_mark)  # fmt: skip
                seen[key] = line
            except TypeError:  # an unhashable key: the base constructor says so
                break
        return super().construct_mapping(node, deep)


def _resolve(p: Path, root: Path) -> Path:
    p = p.expanduser()
    return p if p.is_absolute() else Path(os.path.normpath(root / p))
