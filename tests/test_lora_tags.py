"""AUTOMATIC1111's LoRA tags (``<lora:name:0.8>``): the parser against A1111's own steps, and the
doors that take them (the A1111 routes with the real ``webuiapi`` client against a real server,
a config's prompts through ``run_config``) against the same adapters given by field.

The parser's reference is ``_a1111``: A1111 1.10's code path restated step by step (cited
there), ending in the scale each LoRA's delta is added at, not the parser under test.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
import json
import re

import httpx
import numpy as np
import pytest
import yaml
from PIL import Image

from edit_rt.runtime.errors import ConfigError, LoraTagError, PromptSyntaxError
from edit_rt.runtime.model.lora_tags import lora_tags
from edit_rt.runtime.model.weighting import prompt_spans

from .server_process import ServerProcess

STEPS = 6
BASE = {"prompt": "x", "steps": STEPS, "guidance": 7.5, "width": 32, "height": 32}


# --- the parser ---------------------------------------------------------------------------------


def _a1111(prompt: str) -> tuple[str, dict[str, tuple[float, float]]]:
    """What A1111 1.10 runs for ``prompt``: (the text its encoder sees, each LoRA's summed
    (text encoder, UNet) multiplier over the deltas it adds)."""
    by_type: dict[str, list[list[str]]] = {}

    def found(m):  # modules/extra_networks.py parse_prompt: each tag replaced by "", args split on ":"
        by_type.setdefault(m.group(1), []).append(m.group(2).split(":"))
        return ""

    text = re.sub(r"<(\w+):([^>]+)>", found, prompt)
    # lookup_extra_networks: per type in first-appearance order, "lyco" (lora_script.py's alias) into lora's list
    params = [items for kind, lists in by_type.items() if kind in ("lora", "lyco") for items in lists]

    class Network:  # network.Network: one object per name (networks_in_memory), multipliers set per tag
        te = unet = 0.0

    in_memory, loaded = {}, []
    for items in params:  # extra_networks_lora.py ExtraNetworkLora.activate
        pairs = [item.split("=", 2) for item in items]  # ExtraNetworkParams
        positional = [item for item, p in zip(items, pairs) if len(p) != 2]
        named = {p[0]: p[1] for p in pairs if len(p) == 2}
        te = float(positional[1]) if len(positional) > 1 else 1.0
        te = float(named.get("te", te))
        unet = float(positional[2]) if len(positional) > 2 else te
        unet = float(named.get("unet", unet))
        net = in_memory.setdefault(positional[0], Network())  # networks.load_networks
        net.te, net.unet = te, unet
        loaded.append((positional[0], net))
    scales: dict[str, tuple[float, float]] = {}
    for name, net in loaded:  # network_apply_weights: every entry's delta, at what its object holds now
        t, u = scales.get(name, (0.0, 0.0))
        scales[name] = (t + net.te, u + net.unet)
    return text, scales


AS_A1111 = [
    "a cat <lora:film:0.7>",
    "<lora:film> a cat",
    "a cat <lora:film:0.5:1.5>, red",
    "<lora:film:te=0.5> named te: the UNet follows it",
    "<lora:film:unet=0.25> only the UNet's",
    "<lora:film:0.3:te=0.9> a named te over the positional one",
    "<lora:film:te=0.1:te=0.6> a key given twice keeps the last",
    "<lora:film: 0.5 > float() takes surrounding whitespace",
    "two <lora:film:0.4> networks <lora:grain:-1.2>",
    "the same name twice <lora:film:0.2> and <lora:film:1>",
    "<lyco:film:0.5> lyco is lora's alias <lora:film:1>",
    "<lora:film:1> types in first-appearance order <lyco:film:0.5> <lora:film:0.2>",
    "(emphasis <lora:film:0.6>:1.2) keeps its text",
    "no tag <lora> nor <lora film>",
]


@pytest.mark.parametrize("prompt", AS_A1111)
def test_tags_read_as_a1111_reads_them(prompt):
    text, scales = _a1111(prompt)
    got = lora_tags(prompt)
    assert got.prompt == text
    assert got.uses == {n: pytest.approx(s) for n, s in scales.items()}


def test_weights_positional_and_named_and_the_same_name_twice():
    assert lora_tags("<lora:x>").uses == {"x": (1.0, 1.0)}
    assert lora_tags("<lora:x:0.7>").uses == {"x": (0.7, 0.7)}
    assert lora_tags("<lora:x:0.5:1.5>").uses == {"x": (0.5, 1.5)}
    assert lora_tags("<lora:x:te=0.5>").uses == {"x": (0.5, 0.5)}  # unet defaults to te after te=
    assert lora_tags("<lora:x:unet=2>").uses == {"x": (1.0, 2.0)}
    # A1111 adds the one network's delta once per tag, at the last tag's multipliers
    assert lora_tags("<lora:x:0.2> <lora:x:1>").uses == {"x": (2.0, 2.0)}
    assert lora_tags("<lora:x:0.35> <lora:x:0.35>").uses == {"x": (0.7, 0.7)}
    both = lora_tags("a <lora:x:0.4>, b <lora:y:-1>")
    assert both.prompt == "a , b " and list(both.uses) == ["x", "y"] and both.scales() == {"x": 0.4, "y": -1.0}
    assert lora_tags("<lora:x:0.5:1>").scales() == {"x": (0.5, 1.0)}


@pytest.mark.parametrize("prompt,needle", [
    ("a cat <lora:x:abc>", "`<lora:x:abc>`: the multiplier 'abc' is not a number"),
    ("<lora:x:a=b=c>", "the multiplier 'a=b=c' is not a number"),  # split('=', 2) makes it positional
    ("<lora:x:nan>", "is not a number"),
    ("<lora:x:1:1:8>", "a dynamic rank (dyn"),
    ("<lora:x:dyn=8>", "a dynamic rank (dyn"),
    ("<lora:x:1:1:8:9>", "it would ignore '9'"),
    ("<lora:x:lbw=1,0,1>", "lbw= is not a parameter of AUTOMATIC1111's Lora"),
    ("<lora::1>", "`<lora::1>` names no LoRA"),
    ("<lora:te=1>", "names no LoRA"),
    ("<lora:x:9>", "multiplier 9 is outside [-8, 8]"),
    ("<lora:x:5> <lora:x:5>", "multiplier 10 (2 tags name 'x'"),
    ("<hypernet:anime:1>", "`<hypernet:anime:1>` is an AUTOMATIC1111 hypernetwork"),
    ("<foo:bar>", "AUTOMATIC1111 has no extra network 'foo'"),
])  # fmt: skip
def test_what_edit_rt_does_not_run_is_refused_naming_the_tag(prompt, needle):
    with pytest.raises(LoraTagError, match=re.escape(needle)):
        lora_tags(prompt)


def test_a_prompt_that_reads_no_tags_points_at_the_adapters_field():
    with pytest.raises(PromptSyntaxError, match=re.escape("adapters: {'film': scale}")):
        prompt_spans("a cat <lora:film:0.8>")
    with pytest.raises(PromptSyntaxError, match="in a negative prompt"):  # A1111 reads it as text there
        prompt_spans("blurry <lora:film:0.8>", negative=True)
    with pytest.raises(PromptSyntaxError, match=re.escape("extra network (hypernet); edit-rt loads none")):
        prompt_spans("<hypernet:anime:1>")


# --- the doors: a real server, webuiapi ------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_build(model_dir, adapter_onnx_dir, tmp_path_factory):
    """An export with adapter slots under build/tiny-sd/onnx, two LoRAs (one converted: the
    other is converted by the refresh test), as `make export` and `edit-rt adapters` lay them out."""
    from edit_rt.export.compile.adapters import convert_adapters
    from edit_rt.runtime.engine.manifest import load_manifest

    from .test_adapters import make_lora

    root = tmp_path_factory.mktemp("lora-tags")
    onnx = adapter_onnx_dir  # the session's export with adapter slots (conftest.py)
    loras = {"film": make_lora(model_dir, root / "film", seed=5), "late": make_lora(model_dir, root / "late", seed=9, text=False)}
    converted = convert_adapters(model_dir, load_manifest(onnx), {"film": loras["film"]}, onnx.parent / "adapters")
    return {"root": root, "onnx": onnx, "loras": loras, "converted": converted}


@pytest.fixture(scope="module")
def server(lora_build, model_dir):
    proc = ServerProcess(lora_build["root"], model_dir, lora_build["onnx"], base=BASE,
                         extra={"adapters": {"film": str(lora_build["loras"]["film"])}})  # fmt: skip
    yield proc
    assert proc.stop()


@pytest.fixture(scope="module")
def api(server):
    import webuiapi

    return webuiapi.WebUIApi(host="127.0.0.1", port=server.port, steps=STEPS)


@pytest.fixture(scope="module")
def pipe(lora_build, model_dir):
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    with EditPipeline(lora_build["onnx"], model_dir, adapters=lora_build["converted"]) as p:
        yield p


def _u8(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def _base(server, bid: str):
    from edit_rt.runtime.model.edit import Base

    return Base(**httpx.get(f"{server.url}/v1/bases/{bid}", timeout=30).json()["base"])


def test_txt2img_tag_is_the_bases_adapter_as_the_pipeline_runs_it(api, server, pipe):
    from edit_rt.runtime.pipeline.images import to_uint8

    out = api.txt2img(prompt="a red circle <lora:film:0.7>", seed=11, width=32, height=32, steps=STEPS)
    base = _base(server, out.info["base_id"])
    assert base.prompt == "a red circle " and base.adapters == {"film": 0.7} and out.info["adapters"] == {"film": [0.7, 0.7]}
    expected = to_uint8(pipe.decode(pipe.generate_base(base).final_latent)[0])
    assert np.array_equal(_u8(out.image), expected), np.abs(_u8(out.image).astype(int) - expected).max()
    plain = api.txt2img(prompt="a red circle ", seed=11, width=32, height=32, steps=STEPS)
    assert np.abs(_u8(plain.image).astype(int) - expected).max() > 2  # the LoRA matters at this scale
    # A1111's other spellings of the same multipliers: the same base (its id, so the store's copy)
    for spelling in ("<lora:film:0.7:0.7>", "<lora:film:te=0.7>", "<lora:film:0.35><lyco:film:0.35>"):
        again = api.txt2img(prompt=f"a red circle {spelling}", seed=11, width=32, height=32, steps=STEPS)
        assert again.info["base_id"] == out.info["base_id"], spelling


def test_img2img_tag_equals_the_edit_rt_apis_adapters_field(api, server):
    base = api.txt2img(prompt="a red circle on a blue background", seed=3, width=32, height=32, steps=STEPS)
    tagged = api.img2img(images=[base.image], prompt="a green circle <lora:film:0.7>", denoising_strength=0.5, seed=4,
                         cfg_scale=6.0, width=32, height=32)  # fmt: skip
    assert tagged.info["base_ids"] == [base.info["base_id"]] and tagged.info["adapters"] == {"film": [0.7, 0.7]}
    body = {"base_id": base.info["base_id"], "edits": [{"prompt": "a green circle ", "tail_fraction": 0.5, "seed": 4,
                                                        "cfg_scale": 6.0, "adapters": {"film": 0.7}}]}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/images/edits", json=body, timeout=120)
    assert r.status_code == 200, r.text
    field = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
    assert np.array_equal(_u8(tagged.image), _u8(field))
    plain = api.img2img(images=[base.image], prompt="a green circle ", denoising_strength=0.5, seed=4, cfg_scale=6.0,
                        width=32, height=32)  # fmt: skip
    assert not np.array_equal(_u8(plain.image), _u8(field))


def test_an_unknown_lora_is_a_400_naming_it_and_the_server_goes_on(api, server):
    with pytest.raises(RuntimeError) as err:
        api.txt2img(prompt="a cat <lora:nope:1>", width=32, height=32, steps=STEPS)
    status, text = err.value.args
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "prompt" and error["code"] == "unknown_adapter"
    assert "'nope'" in error["message"] and "film" in error["message"], error
    for route, extra in (("txt2img", {}), ("img2img", {"init_images": [base64.b64encode(_png()).decode()]})):
        for changes, param in (({"prompt": "a <lora:film:abc>"}, "prompt"), ({"prompt": "a <hypernet:h:1>"}, "prompt"),
                               ({"negative_prompt": "<lora:film:1>"}, "negative_prompt")):  # fmt: skip
            body = {"prompt": "a cat", "width": 32, "height": 32, "steps": STEPS, **extra, **changes}
            r = httpx.post(f"{server.url}/sdapi/v1/{route}", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.text)
    plain = api.txt2img(prompt="a cat", width=32, height=32, steps=STEPS)  # the server goes on
    r = httpx.post(f"{server.url}/sdapi/v1/txt2img", timeout=60, json={"prompt": "a cat <lora:nope:1>", "width": 32,
                   "height": 32, "steps": STEPS, "disable_extra_networks": True})  # webuiapi does not send it  # fmt: skip
    off = json.loads(r.json()["info"])
    assert "adapters" not in off and off["accepted"]["prompt"].startswith("'a cat '"), r.text
    # the edit-rt API reads no tag: it says where the adapter goes
    r = httpx.post(f"{server.url}/v1/images/edits", timeout=60, json={"base_id": plain.info["base_id"],
                   "edits": [{"prompt": "a dog <lora:film:0.5>"}]})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "edits[0].prompt" and "adapters" in r.text, r.text


def _png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_get_loras_lists_the_configured_adapters_in_a1111s_shape(api, lora_build):
    (entry,) = api.get_loras()
    assert {"name", "alias", "path", "metadata"} <= set(entry) and entry["name"] == entry["alias"] == "film"
    # the file as a client may see it: never the server's absolute layout (issue 35)
    shown = Path(entry["path"])
    assert not shown.is_absolute() and shown.name == Path(lora_build["loras"]["film"]).name, entry["path"]
    assert isinstance(entry["metadata"], dict)
    assert entry["edit_rt"]["rank"] == 4 and "unet_step" in entry["edit_rt"]["graphs"]


def test_refresh_loras_serves_a_lora_converted_after_the_server_started(api, server, lora_build, model_dir):
    from edit_rt.export.compile.adapters import convert_adapters
    from edit_rt.runtime.engine.manifest import load_manifest

    with pytest.raises(RuntimeError, match="unknown_adapter"):
        api.txt2img(prompt="a cat <lora:late:1>", width=32, height=32, steps=STEPS)
    config = yaml.safe_load(server.config.read_text())
    config["adapters"]["late"] = str(lora_build["loras"]["late"])
    server.config.write_text(yaml.safe_dump(config))
    r = api.session.post(f"{api.baseurl}/refresh-loras")  # webuiapi has no refresh_loras: its own session
    assert r.status_code == 400 and "late" in r.text and "edit-rt adapters" in r.text, r.text  # not converted yet
    convert_adapters(model_dir, load_manifest(lora_build["onnx"]), {"late": lora_build["loras"]["late"]},
                     lora_build["onnx"].parent / "adapters")  # fmt: skip
    r = api.session.post(f"{api.baseurl}/refresh-loras")
    assert r.status_code == 200 and r.json() is None, r.text
    assert sorted(e["name"] for e in api.get_loras()) == ["film", "late"]
    late = api.txt2img(prompt="a cat <lora:late:1>", seed=2, width=32, height=32, steps=STEPS)
    plain = api.txt2img(prompt="a cat ", seed=2, width=32, height=32, steps=STEPS)
    assert late.info["adapters"] == {"late": [1.0, 1.0]} and not np.array_equal(_u8(late.image), _u8(plain.image))
    assert api.txt2img(prompt="a cat <lora:film:0.5>", seed=2, width=32, height=32, steps=STEPS).info["adapters"]


# --- a config's prompts ----------------------------------------------------------------------------


def _config(lora_build, model_dir, out: str, base_prompt: str, edit: dict, base_adapters=None) -> dict:
    base = {**BASE, "prompt": base_prompt, "seed": 5, **({"adapters": base_adapters} if base_adapters else {})}
    return {"model": str(model_dir), "build_dir": str(lora_build["onnx"].parent.parent), "output_dir": str(lora_build["root"] / out),
            "adapters": {"film": str(lora_build["loras"]["film"])}, "base": base, "edits": [edit]}  # fmt: skip


def test_a_config_with_tags_runs_as_the_same_config_with_adapters_fields(lora_build, model_dir):
    from edit_rt.runtime.config.load import config_from_dict
    from edit_rt.runtime.apps.run import run_config

    edit = {"prompt": "a green circle", "tail_steps": 3}
    tagged = config_from_dict(_config(lora_build, model_dir, "tagged", "a red circle <lora:film:0.7>",
                                      {**edit, "prompt": "a green circle <lora:film:-0.4>"}))  # fmt: skip
    fields = config_from_dict(_config(lora_build, model_dir, "fields", "a red circle ", {**edit, "prompt": "a green circle ",
                                      "adapters": {"film": -0.4}}, base_adapters={"film": 0.7}))  # fmt: skip
    assert tagged.base == fields.base and tagged.edits == fields.edits
    reports = [run_config(cfg) for cfg in (tagged, fields)]
    assert reports[0]["base_id"] == reports[1]["base_id"]
    for name in ("base.png", "edit_00.png"):
        a, b = (_u8(Image.open(cfg.output_dir / name)) for cfg in (tagged, fields))
        assert np.array_equal(a, b), name


@pytest.mark.parametrize("base_prompt,edit,base_adapters,needle", [
    ("a <lora:film:0.7>", {"prompt": "b"}, {"film": 0.5}, "base.adapters.film: given here and by the prompt's `<lora:film:0.7>`"),
    ("a <lora:grain:1>", {"prompt": "b"}, None, "base.prompt: `<lora:grain:1>` names no adapter of this config's adapters:"),
    ("a", {"prompt": "b <lora:film:0.5:1>"}, None, "edits[0].prompt: `<lora:film:0.5:1>` gives the text encoders 0.5"),
    ("a", {"prompt": "b <lora:film:x>"}, None, "edits[0].prompt: `<lora:film:x>`: the multiplier 'x' is not a number"),
    ("a", {"prompt": "b", "directions": [{"prompt": "c <lora:film:1>"}]}, None, "adapters: {'film': scale}"),
])  # fmt: skip
def test_a_configs_tags_are_refused_by_field(lora_build, model_dir, base_prompt, edit, base_adapters, needle):
    from edit_rt.runtime.config.load import config_from_dict

    with pytest.raises(ConfigError, match=re.escape(needle)):
        config_from_dict(_config(lora_build, model_dir, "refused", base_prompt, edit, base_adapters))


def test_a_configs_base_takes_te_and_unet_apart(lora_build, model_dir):
    from edit_rt.runtime.config.load import config_from_dict

    cfg = config_from_dict(_config(lora_build, model_dir, "apart", "a <lora:film:0.5:1.5>", {"prompt": "b <lora:film:0>"}))
    assert cfg.base.prompt == "a " and cfg.base.adapters == {"film": (0.5, 1.5)}
    assert cfg.edits[0].adapters == {"film": 0.0} and cfg.tail_row(cfg.edits[0]).adapters == {}
