"""A new user's first mistakes, answered first and right (issue 50): the README's own examples
load as written, a wrong model path is the first thing said (before the export, before the
adapters), a missing export names `edit-rt export`, and an adapter name no `adapters:` holds is
refused when the config is read, naming the file and the field, before any step runs.

In process (the console script's own road, cli_in_process.py; load_config), on the session's
tiny model and its export.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from edit_rt.runtime.config.load import config_from_dict, load_config
from edit_rt.runtime.errors import ConfigError

from .cli_in_process import edit_rt

README = Path(__file__).resolve().parents[1] / "README.md"
YAML_BLOCKS = re.findall(r"^```yaml\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _write(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _refusal(args: list[str]) -> str:
    """What `edit-rt ARGS` says of its refusal: its one ``error:`` line, without the prefix
    (exit status 2, nothing else on stderr)."""
    result = edit_rt(*args)
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (result.returncode, result.stderr)
    return lines[0].removeprefix("error: ")


@pytest.fixture
def lora(tmp_path) -> Path:
    """A file an ``adapters:`` entry can name: only its existence is checked before a run."""
    path = tmp_path / "saturation.safetensors"
    path.write_bytes(b"stand-in")
    return path


def _config(tmp_path: Path, model: Path, build_dir: Path, **over) -> dict:
    return {"model": str(model), "build_dir": str(build_dir), "output_dir": str(tmp_path / "out"),
            "base": {"prompt": "a red circle", "steps": 4, "width": 32, "height": 32},
            "edits": [{"prompt": "a green circle"}], **over}  # fmt: skip


# --- the README's examples --------------------------------------------------------------------


def test_the_readme_has_yaml_examples():
    assert YAML_BLOCKS, "README.md has no ```yaml block: the test below would check nothing"


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[f"block{k}" for k in range(len(YAML_BLOCKS))])
def test_each_readme_yaml_block_loads_as_written(tmp_path, model_dir, block):
    """Only what cannot exist on a test machine is replaced: a checkpoint under ~/models/ is
    the tiny model written as a single file of the same name, in tmp_path."""
    from .ldm_layout import write_single_file

    model = yaml.safe_load(block)["model"]
    text = block
    if not Path(model).expanduser().exists():
        stand_in = tmp_path / Path(model).name
        write_single_file(model_dir, stand_in)
        text = block.replace(f"model: {model}", f"model: {stand_in}", 1)
        assert text != block  # the substitution is the model line's, and only that
    path = tmp_path / "readme.yaml"
    path.write_text(text)
    cfg = load_config(path)
    written = yaml.safe_load(block)
    for key, value in (written.get("engines") or {}).items():  # what the example says is what it gets
        assert getattr(cfg.engines, key) == value


def test_opt_batch_follows_a_smaller_max_batch():
    """The README's `engines: {max_batch: 4}` tunes for 4 rows, not the default 8 it cannot reach."""

    def engines(**e):
        return config_from_dict({"model": "m", "base": {"prompt": "x"}, "engines": e}).engines

    assert (engines().min_batch, engines().opt_batch, engines().max_batch) == (1, 8, 32)
    assert engines(max_batch=4).opt_batch == 4
    assert engines(max_batch=1).opt_batch == 1
    assert engines(min_batch=12, max_batch=16).opt_batch == 12  # within min..max, as TensorRT requires
    assert engines(max_batch=4, opt_batch=2).opt_batch == 2  # given: kept


def test_an_opt_batch_set_above_max_batch_is_refused_naming_it_and_the_fix():
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"model": "m", "base": {"prompt": "x"}, "engines": {"max_batch": 4, "opt_batch": 8}})
    message = str(refused.value)
    assert message.startswith("engines.opt_batch: 8") and "1..4" in message and "leave it out" in message, message


# --- the order of the refusals ----------------------------------------------------------------


def test_run_says_a_wrong_model_path_first(tmp_path, lora):
    """Not the adapters' conversion (whose command would then say the manifest is missing)."""
    config = _write(tmp_path, _config(tmp_path, tmp_path / "no-such-model", tmp_path / "build", adapters={"saturation": str(lora)}))
    message = _refusal(["run", str(config)])
    assert message.startswith(f"{config}: model: ") and "no-such-model does not exist" in message, message
    assert "adapters" not in message.split(";")[0]
    assert not (tmp_path / "out").exists()  # nothing made before the refusal


def test_serve_says_a_wrong_model_path_first(tmp_path, lora):
    from edit_rt.runtime.serving.service import Service

    config = _write(tmp_path, _config(tmp_path, tmp_path / "no-such-model", tmp_path / "build", adapters={"saturation": str(lora)}))
    service = Service(load_config(config))
    service.load()  # what `edit-rt serve` runs once its port is bound; /health reports the error
    assert service.load_error is not None and service.load_error.startswith(f"{config}: model: "), service.load_error
    assert "no-such-model does not exist" in service.load_error


def test_export_says_a_wrong_model_path_first(tmp_path):
    config = _write(tmp_path, _config(tmp_path, tmp_path / "no-such-model", tmp_path / "build"))
    message = _refusal(["export", str(config)])
    assert message.startswith(f"{config}: model: ") and "no-such-model does not exist" in message, message


def test_a_wrong_checkpoint_path_is_refused_at_load_naming_model(tmp_path):
    config = _write(tmp_path, _config(tmp_path, tmp_path / "v1-5-pruned-emaonly.safetensors", tmp_path / "build"))
    for command in ("run", "export", "serve"):
        message = _refusal([command, str(config)])
        assert message.startswith(f"{config}: model: ") and "not found; fix the path" in message, (command, message)


def test_run_before_export_names_the_export_command_not_the_adapters(tmp_path, model_dir, lora):
    config = _write(tmp_path, _config(tmp_path, model_dir, tmp_path / "build", adapters={"saturation": str(lora)}))
    message = _refusal(["run", str(config)])
    assert f"edit-rt export {config}" in message and "manifest.json not found" in message, message
    assert "adapters" not in message


def test_adapters_before_export_names_the_export_command(tmp_path, model_dir, lora):
    config = _write(tmp_path, _config(tmp_path, model_dir, tmp_path / "build", adapters={"saturation": str(lora)}))
    message = _refusal(["adapters", str(config)])
    assert f"edit-rt export {config}" in message, message


def test_unconverted_adapters_come_after_the_model_and_the_export(tmp_path, model_dir, onnx_dir, lora):
    config = _write(tmp_path, _config(tmp_path, model_dir, onnx_dir.parent.parent, adapters={"saturation": str(lora)}))
    message = _refusal(["run", str(config)])
    assert message.startswith("adapters.saturation: not converted") and f"edit-rt adapters {config}" in message, message


# --- adapter names, at load -------------------------------------------------------------------


SWEEP = {"adapter": "saturaton", "from": -2, "to": 2, "n": 5}  # the user's typo of "saturation"


@pytest.mark.parametrize(
    "over,field",
    [
        ({"edits": [{"prompt": "a"}] * 13 + [{"prompt": "b", "sweep": SWEEP}]}, "edits[13].sweep.adapter"),
        ({"edits": [{"prompt": "a"}, {"prompt": "b", "adapters": {"saturaton": 1.0}}]}, "edits[1].adapters.saturaton"),
        ({"base": {"prompt": "a", "adapters": {"saturaton": 1.0}}}, "base.adapters.saturaton"),
        ({"catalogue": {"edits": [{"prompt": "a"}], "sliders": [SWEEP]}}, "catalogue.sliders[0].adapter"),
        ({"catalogue": {"edits": [{"prompt": "a", "adapters": {"saturaton": 1}}]}}, "catalogue.edits[0].adapters.saturaton"),
    ],
)  # fmt: skip
def test_an_unknown_adapter_is_refused_at_load_naming_the_file_and_field(tmp_path, lora, over, field):
    config = _write(tmp_path, {"model": "m", "base": {"prompt": "a"}, "adapters": {"saturation": str(lora)}, **over})
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    message = str(refused.value)
    assert message.startswith(f"{config}: {field}: 'saturaton'") and "saturation" in message.split("'saturaton'", 1)[1], message


def test_an_unknown_sweep_adapter_stops_run_before_any_step(tmp_path, model_dir, onnx_dir, lora):
    edits = [{"prompt": "a green circle", "tail_steps": 2}] * 13 + [{"prompt": "b", "sweep": SWEEP}]
    config = _write(tmp_path, _config(tmp_path, model_dir, onnx_dir.parent.parent, adapters={"saturation": str(lora)}, edits=edits))
    refused = _refusal(["run", str(config)])  # the class, ConfigError: the test above, at load_config
    assert refused.startswith(f"{config}: edits[13].sweep.adapter: "), refused
    assert not (tmp_path / "out").exists()  # no base, no tail: the refusal came before the run


def test_a_known_sweep_adapter_still_expands_into_its_rows(tmp_path, lora):
    sweep = {**SWEEP, "adapter": "saturation"}
    config = _write(tmp_path, {"model": "m", "base": {"prompt": "a"}, "adapters": {"saturation": str(lora)},
                               "edits": [{"prompt": "b", "sweep": sweep}]})  # fmt: skip
    cfg = load_config(config)
    assert [e.adapters for e in cfg.edits] == [{"saturation": v} for v in (-2.0, -1.0, 0.0, 1.0, 2.0)]
