"""ComfyUI's own frontend served by edit-rt (issue 53, item 4: ``serve.comfyui_frontend``).

The promise, in a real headless Chromium (Debian's) against a real server on loopback with every
other host unreachable: comfyui-frontend-package's page loads with no failed request and no
console error, its own node registry holds edit-rt's nodes, the workflow the server offers opens
from the page's template browser, its widgets are set from the page's dropdowns to what the server
serves, the page queues it, shows its progress and its image. Screenshots go to
``out/test-artifacts/`` (ignored by git), their paths printed.

And without a browser: the user store keeps users apart and refuses names that leave a user's
folder, naming the field; settings round-trip; the routes take the server's credentials; the
setting is refused, naming the fix, without ComfyUI's door or without the package. The
references are ComfyUI's own answers (app/user_manager.py, app/app_settings.py) and what the
page itself reports.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from edit_rt.runtime.config.load import config_from_dict
from edit_rt.runtime.errors import ConfigError
from edit_rt.runtime.web.comfyui_userdata import DEFAULT_USER, UserData
from edit_rt.runtime.web.http_errors import ApiError

from .server_process import ServerProcess
from .test_page import offline, screenshot
from .test_web import CHROMIUM, _launch

BASE = {"prompt": "x", "steps": 4, "guidance": 7.5, "width": 32, "height": 32}


# --- the user store, on its own ---------------------------------------------------------------


def test_users_keep_their_files_and_settings_apart(tmp_path):
    store = UserData(tmp_path)
    assert store.users_answer() == {"storage": "server", "migrated": False}  # ComfyUI's single-user answer
    ada = store.add_user("ada")
    assert store.users_answer() == {"storage": "server", "users": {ada: "ada"}}
    assert store.user_of(None) == DEFAULT_USER and store.user_of(ada) == ada
    store.write(DEFAULT_USER, "workflows/a.json", b"default's", overwrite=True)
    store.write(ada, "workflows/a.json", b"ada's", overwrite=True)
    store.update_settings(ada, {"Comfy.Locale": "fr"})
    assert store.read(DEFAULT_USER, "workflows/a.json").read_bytes() == b"default's"
    assert store.read(ada, "workflows/a.json").read_bytes() == b"ada's"
    assert store.settings(DEFAULT_USER) == {} and store.settings(ada) == {"Comfy.Locale": "fr"}
    with pytest.raises(ApiError) as unknown:
        store.user_of("mallory")
    assert unknown.value.status == 403 and unknown.value.param == "comfy-user"
    with pytest.raises(ApiError) as taken:
        store.add_user("ada")
    assert taken.value.status == 400 and taken.value.param == "username"


@pytest.mark.parametrize("name", ["../x.json", "workflows/../../x.json", "/etc/passwd", "C:/x.json", "a\\b.json",
                                  "./a.json", "workflows//a.json", ""])  # fmt: skip
def test_a_name_outside_the_users_folder_is_refused_naming_the_field(tmp_path, name):
    store = UserData(tmp_path / "user")
    for call in (lambda: store.write(DEFAULT_USER, name, b"x", overwrite=True), lambda: store.read(DEFAULT_USER, name),
                 lambda: store.listing(DEFAULT_USER, name, True, False, False)):  # fmt: skip
        with pytest.raises(ApiError) as refused:
            call()
        assert refused.value.status in (400, 403) and refused.value.param in ("file", "dir"), refused.value.message
    assert not any(p.is_file() for p in tmp_path.rglob("*"))  # nothing written anywhere


def test_a_symbolic_link_out_of_the_folder_leads_nowhere(tmp_path):
    store = UserData(tmp_path / "user")
    (tmp_path / "user" / DEFAULT_USER).mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "user" / DEFAULT_USER / "out").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ApiError) as refused:
        store.write(DEFAULT_USER, "out/x.json", b"x", overwrite=True)
    assert refused.value.status == 403 and refused.value.code == "path_escape"
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_settings_round_trip_overwrite_and_the_quota(tmp_path):
    store = UserData(tmp_path, max_user_bytes=200)
    store.update_settings(DEFAULT_USER, {"Comfy.A": 1})
    store.update_settings(DEFAULT_USER, {"Comfy.B": [1, "two"], "Comfy.A": None})
    assert store.settings(DEFAULT_USER) == {"Comfy.A": None, "Comfy.B": [1, "two"]}
    store.write(DEFAULT_USER, "w.json", b"1" * 100, overwrite=True)
    with pytest.raises(ApiError) as exists:
        store.write(DEFAULT_USER, "w.json", b"2", overwrite=False)
    assert exists.value.status == 409
    store.write(DEFAULT_USER, "w.json", b"2" * 120, overwrite=True)  # a file replaced counts once
    with pytest.raises(ApiError) as full:
        store.write(DEFAULT_USER, "v.json", b"3" * 100, overwrite=True)
    assert full.value.status == 413 and full.value.code == "quota_exceeded"


def test_the_queue_reads_as_comfyuis_jobs():
    """comfy_execution/jobs.py's shape, with what the frontend's schema requires (a number
    ``create_time``, string error fields): a running, a pending, a failed and a done prompt."""
    from types import SimpleNamespace

    from edit_rt.runtime.web.comfyui_jobs import all_jobs

    image = {"filename": "ComfyUI_00001_.png", "subfolder": "", "type": "output"}
    item = lambda pid, n: SimpleNamespace(prompt_id=pid, number=n, extra_data={"create_time": 5}, messages=[])  # noqa: E731
    done = {"prompt": [0, "d", {}, {}, ["9"]], "outputs": {"9": {"images": [image]}},
            "status": {"status_str": "success", "messages": [["execution_start", {"timestamp": 10}],
                                                             ["execution_success", {"timestamp": 20}]]}}  # fmt: skip
    failed = {"prompt": [1, "f", {}, {}, ["9"]], "outputs": {},
              "status": {"status_str": "error", "messages": [["execution_error", {"node_id": None, "timestamp": 30}]]}}  # fmt: skip
    queue = SimpleNamespace(running={"r": item("r", 3)}, pending=[item("p", 4)], history={"d": done, "f": failed})
    jobs = all_jobs(queue)
    assert [(j["id"], j["status"]) for j in jobs] == [("r", "in_progress"), ("p", "pending"), ("f", "failed"), ("d", "completed")]
    assert all(isinstance(j["create_time"], int) for j in jobs) and jobs[0]["create_time"] == 5
    assert jobs[3]["preview_output"] == {**image, "nodeId": "9", "mediaType": "images"} and jobs[3]["outputs_count"] == 1
    assert jobs[3]["execution_start_time"] == 10 and jobs[3]["execution_end_time"] == 20
    assert jobs[2]["execution_error"]["node_id"] == "" and jobs[2]["execution_error"]["traceback"] == []


# --- the setting and the app, without engines -------------------------------------------------


def _config(tmp_path: Path, **serve) -> dict:
    return {"model": str(tmp_path / "tiny-sd"), "base": BASE, "serve": serve}


def test_the_setting_names_what_it_needs(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"serve\.comfyui_frontend: .*set serve\.comfyui: true"):
        config_from_dict(_config(tmp_path, comfyui_frontend=True))
    monkeypatch.setattr("edit_rt.runtime.config.serve.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"serve\.comfyui_frontend: .*pip install 'edit-rt\[comfyui\]'"):
        config_from_dict(_config(tmp_path, comfyui=True, comfyui_frontend=True))


def _get(app, path: str, headers: dict | None = None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8188") as c:
            return await c.get(path, headers=headers)

    return asyncio.run(go())


def test_the_page_is_at_root_the_editing_page_at_editor_and_credentials_guard_the_routes(tmp_path):
    """No engines are loaded (no lifespan): a route past the credentials answers 503, one
    without them 401, the page's own files 200."""
    from edit_rt.runtime.web.server import create_app, listening_line

    cfg = config_from_dict(_config(tmp_path, comfyui=True, comfyui_frontend=True, token="sesame",
                                   comfyui_user_dir=str(tmp_path / "user")))  # fmt: skip
    assert "ComfyUI's frontend at /, the editing page at /editor" in listening_line(cfg)
    on = create_app(cfg)
    assert "<title>ComfyUI</title>" in _get(on, "/").text
    assert "<title>edit-rt</title>" in _get(on, "/editor").text
    for path in ("/api/settings", "/api/userdata/user.css", "/user.css", "/api/jobs", "/settings"):
        assert _get(on, path).status_code == 401, path
        assert _get(on, path, {"Authorization": "Bearer sesame"}).status_code == 503, path
    assert _get(on, "/assets/no-such-file.js").status_code == 404
    off = create_app(config_from_dict(_config(tmp_path, comfyui=True)))
    assert "<title>edit-rt</title>" in _get(off, "/").text and _get(off, "/api/settings").status_code == 404


# --- a real server: the routes over HTTP, and the page in Chromium ------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    tmp = tmp_path_factory.mktemp("comfyui-frontend")
    proc = ServerProcess(tmp, model_dir, onnx_dir, base=BASE, serve={"comfyui": True, "comfyui_frontend": True,
                                                                     "comfyui_user_dir": str(tmp / "user")})  # fmt: skip
    yield proc
    assert proc.stop()


def test_userdata_over_http_as_the_page_sends_it(server):
    """Names encoded whole (``workflows%2Fa.json``), a move, the listing shapes, ``comfy-user``."""
    c, users = server.client, Path(server.config).parent / "user" / "users.json"
    try:
        _userdata_round(c)
    finally:  # the page loads single-user only while no user was added: none is left for the browser test
        users.unlink(missing_ok=True)


def _userdata_round(c: httpx.Client) -> None:
    assert c.post("/api/userdata/" + quote("workflows/a.json", safe=""), content=b'{"a": 1}').json() == "workflows/a.json"
    moved = c.post(f"/api/userdata/{quote('workflows/a.json', safe='')}/move/{quote('workflows/b c.json', safe='')}",
                   params={"full_info": "true"})  # fmt: skip
    assert moved.status_code == 200 and moved.json()["path"] == "workflows/b c.json"
    listed = c.get("/api/userdata", params={"dir": "workflows", "recurse": "true", "full_info": "true"}).json()
    assert [f["path"] for f in listed] == ["b c.json"] and listed[0]["size"] == 8
    assert c.get("/api/v2/userdata").json()[0] == {"name": "workflows", "path": "workflows", "type": "directory"}
    assert c.get("/api/userdata/" + quote("workflows/b c.json", safe="")).json() == {"a": 1}
    escape = c.post("/api/userdata/" + quote("../../x.json", safe=""), content=b"{}")
    assert escape.status_code == 403 and escape.json()["error"]["param"] == "file"
    assert c.get("/api/userdata", params={"dir": "../"}).json()["error"]["param"] == "dir"
    ada = c.post("/api/users", json={"username": "ada"}).json()
    assert c.get("/api/userdata", params={"dir": "workflows"}, headers={"comfy-user": ada}).json() == []
    assert c.post("/api/settings/Comfy.Locale", json="fr", headers={"comfy-user": ada}).status_code == 200
    assert c.get("/api/settings/Comfy.Locale", headers={"comfy-user": ada}).json() == "fr"
    assert c.get("/api/settings/Comfy.Locale").json() is None
    assert c.get("/api/settings", headers={"comfy-user": "nobody"}).status_code == 403
    assert c.delete("/api/userdata/" + quote("workflows/b c.json", safe="")).status_code == 204
    assert c.delete("/api/userdata/workflows").status_code == 404  # a folder is no file


# Set from the page's own dropdowns, as a user picks them: each value must be one of the
# widget's options (the server's /object_info lists). ddim + ddim_uniform: a pair that runs.
PICKS = {"CheckpointLoaderSimple": {"ckpt_name": None}, "KSampler": {"sampler_name": "ddim", "scheduler": "ddim_uniform",
                                                                    "seed": 7, "steps": 4},
         "EmptyLatentImage": {"width": 32, "height": 32}}  # fmt: skip

PICK = """([picks]) => {
  const out = {};
  for (const node of app.graph._nodes) {
    for (const [name, wanted] of Object.entries(picks[node.type] || {})) {
      const w = node.widgets.find(w => w.name === name);
      const options = w.options && Array.isArray(w.options.values) ? w.options.values : null;
      const value = wanted === null ? options[0] : wanted;
      if (options && !options.includes(value)) throw new Error(`${name}: ${value} is not offered (${options})`);
      w.value = value;
      if (w.callback) w.callback(value);
      out[`${node.type}.${name}`] = [w.value, options];
    }
  }
  return out;
}"""


SAVED_IMAGE = "(() => { const img = (app.graph._nodes.find(n => n.type === 'SaveImage').imgs || [])[0]"


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_frontend_loads_offline_lists_edit_rts_nodes_and_runs_the_offered_workflow(server):
    from playwright.sync_api import sync_playwright

    failed, errors, progress = [], [], []
    with sync_playwright() as p:
        browser = _launch(p)
        context = browser.new_context(viewport={"width": 1400, "height": 900})

        refused = offline(context)  # every host but this server is unreachable
        page = context.new_page()
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("response", lambda r: r.status >= 400 and failed.append(f"{r.status} {r.request.method} {r.url}"))
        page.on("requestfailed", lambda r: failed.append(f"{r.failure} {r.method} {r.url}"))
        page.goto(server.url + "/")
        # a first visit opens the template browser (ComfyUI's), where the server's workflow is offered
        page.get_by_text("text_to_image").first.wait_for(timeout=60_000)
        registered = page.evaluate("Object.keys(LiteGraph.registered_node_types)")
        screenshot(page, "comfyui-frontend-templates.png")
        page.get_by_text("text_to_image").first.click()
        page.wait_for_function("app.graph._nodes.length === 7 && app.graph._nodes.some(n => n.type === 'KSampler')")
        picked = page.evaluate(PICK, [PICKS])
        page.evaluate("app.api.addEventListener('progress', e => (window.__progress ||= []).push(e.detail))")
        screenshot(page, "comfyui-frontend-workflow.png")
        page.get_by_role("button", name="Run").first.click()
        # the image the SaveImage node shows: the <img> the page loaded from /view and draws on
        # the node (the "Job completed" toast's copy comes seconds later, after its next poll)
        page.wait_for_function(SAVED_IMAGE + "; return img && img.complete && img.naturalWidth > 0; })()", timeout=60_000)
        size, src = page.evaluate(SAVED_IMAGE + "; return [[img.naturalWidth, img.naturalHeight], img.src]; })()")
        progress = page.evaluate("window.__progress || []")
        # the page's own client saves the workflow into the user's folder and lists it back
        saved = page.evaluate("""async () => {
          await app.api.storeUserData('workflows/edit-rt text to image.json', app.graph.serialize(),
                                      {overwrite: false, full_info: true, stringify: true, throwOnError: true});
          return (await app.api.listUserDataFullInfo('workflows')).map(f => f.path);
        }""")
        screenshot(page, "comfyui-frontend-done.png")
        context.close()
        browser.close()
    assert refused == [] and failed == [] and errors == [], (refused, failed, errors)
    assert {"EditRtStoredBase", "EditRtEdit", "KSampler", "CheckpointLoaderSimple"} <= set(registered)
    assert picked["CheckpointLoaderSimple.ckpt_name"][0] == "tiny-sd"  # the served checkpoint, the one offered
    assert picked["KSampler.sampler_name"][0] == "ddim" and picked["KSampler.scheduler"][0] == "ddim_uniform"
    assert progress and progress[-1]["value"] <= progress[-1]["max"] and progress[-1]["max"] > 0, progress
    assert size == [32, 32] and "/api/view?" in src and "type=output" in src
    assert saved == ["edit-rt text to image.json"]
    stored = json.loads((Path(server.config).parent / "user" / "default" / "workflows" / saved[0]).read_text())
    assert {n["type"] for n in stored["nodes"]} >= {"CheckpointLoaderSimple", "KSampler", "SaveImage"}
    # the page queued what it showed: the history's prompt carries the picks
    history = server.client.get("/api/history").json()
    [entry] = [e for e in history.values() if e["prompt"][2]["3"]["inputs"]["sampler_name"] == "ddim"]
    assert entry["status"]["status_str"] == "success"
    assert json.dumps(entry["prompt"][2]["3"]["inputs"]["seed"]) == "7"
