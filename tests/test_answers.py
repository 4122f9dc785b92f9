"""Answers a client reads as it expects (issue 35, item 7), from a real `edit-rt serve` on loopback.

- **405 with the methods the path serves**: a method a path does not serve is 405 whose
  ``Allow`` lists every method served there (the OpenAPI document's methods for the path; each
  listed method really answered, each other one really 405), before any content-type (415) or
  length (411) rule; an unknown path stays 404.
- **Authentication as clients send it**: a 401 carries ``WWW-Authenticate`` challenges (RFC 6750's
  ``Bearer``, RFC 7617's ``Basic`` when ``serve.api_auth`` is set), the scheme word is
  case-insensitive (RFC 7235), and ``webuiapi``'s ``set_auth`` (HTTP Basic, as AUTOMATIC1111's
  ``--api-auth``) gets in.
- **Metrics labelled by route template**: every request, refused or served, is counted under
  the template of the route its path matches (FastAPI's own OpenAPI paths are the reference) or
  ``unmatched``, so a client choosing paths cannot grow the label set.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess

import httpx
import pytest

from edit_rt.runtime.config.load import config_from_dict
from edit_rt.runtime.errors import ConfigError

from .server_process import ServerProcess, serve_to_its_end

TOKEN = "tökén-1"
USERS = {"alice": "open sesame", "bob": "pa:ss"}  # a colon in a password: only the first one splits
BEARER = {"authorization": b"Bearer " + TOKEN.encode()}
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
# Served, but not in the OpenAPI document (include_in_schema=False, or the document itself)
UNDOCUMENTED = {"/": {"GET"}, "/docs": {"GET"}, "/redoc": {"GET"}, "/docs/assets/{name}": {"GET"},
                "/openapi.json": {"GET", "HEAD"}}  # fmt: skip
PROMTOOL = shutil.which("promtool")


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, onnx_dir):
    api_auth = ",".join(f"{user}:{password}" for user, password in USERS.items())
    proc = ServerProcess(tmp_path_factory.mktemp("answers"), model_dir, onnx_dir,
                         env={"EDIT_RT_TOKEN": TOKEN, "EDIT_RT_API_AUTH": api_auth})  # fmt: skip
    yield proc
    assert proc.stop()


@pytest.fixture(scope="module")
def served(server) -> dict[str, set[str]]:
    """Every route template -> the methods it serves: the OpenAPI document's, and the pages' own."""
    paths = httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]
    return {**{path: {m.upper() for m in ops} for path, ops in paths.items()}, **UNDOCUMENTED}


def _example(template: str) -> str:
    """A concrete path for a route template: any value fits a ``{param}`` (str convertors)."""
    return re.sub(r"\{[^}]+\}", "0123456789abcdef01234567", template)


def _allow(response: httpx.Response) -> set[str]:
    return {m.strip() for m in response.headers.get("allow", "").split(",") if m.strip()}


# --- 405 ------------------------------------------------------------------------------------------


def test_a_method_a_path_does_not_serve_is_405_listing_all_it_serves(server, served):
    """Every route x every method: the Allow of a 405 is the path's methods, and a method in it
    answers something else than 405. Refusals carry no body and no Content-Type (a schemathesis
    case: a bodiless POST to a GET route was 415 before it was routed)."""
    wrong = []
    with httpx.Client(base_url=server.url, headers=BEARER, timeout=60) as client:
        for template, methods in sorted(served.items()):
            path = _example(template)
            for method in METHODS:
                if method in methods:
                    # a JSON array is no route's body: a 400 at worst, never any work
                    sends_body = method in ("POST", "PUT", "PATCH")
                    body = {"content": b"[]", "headers": {"content-type": "application/json"}} if sends_body else {}
                    r = client.request(method, path, **body)
                    if r.status_code == 405:
                        wrong.append(f"{method} {path}: 405 although the path serves it")
                    continue
                r = client.request(method, path)
                if r.status_code != 405 or _allow(r) != methods:
                    wrong.append(f"{method} {path}: {r.status_code} Allow {sorted(_allow(r))}, wanted 405 Allow {sorted(methods)}")
    assert not wrong, "\n".join(wrong)


def test_put_options_lists_get_and_post_and_a_bodiless_post_to_a_get_route_is_405(server):
    r = httpx.put(server.url + "/sdapi/v1/options", headers=BEARER, content=b"{}")
    assert r.status_code == 405 and _allow(r) == {"GET", "POST"}
    assert r.json()["error"]["type"] == "invalid_request_error"
    # no Content-Type, no body, no Content-Length: neither 415 nor 411 comes first
    for headers in ({}, {"content-length": "0"}):
        r = httpx.post(server.url + "/sdapi/v1/sd-models", headers={**BEARER, **headers})
        assert r.status_code == 405 and _allow(r) == {"GET"}, r.text


def test_an_unknown_path_stays_404(server):
    for method in ("GET", "POST", "PUT"):
        r = httpx.request(method, server.url + "/v1/no-such-route", headers=BEARER)
        assert r.status_code == 404 and "allow" not in r.headers, (method, r.status_code, r.text)


# --- authentication -------------------------------------------------------------------------------


def _challenges(response: httpx.Response) -> dict[str, str]:
    """``WWW-Authenticate``'s challenges, scheme (lowercased) -> its parameters."""
    found = {}
    for value in response.headers.get_list("www-authenticate"):
        scheme, _, params = value.strip().partition(" ")
        found[scheme.lower()] = params
    return found


def test_a_401_names_the_schemes_it_takes(server):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic " + base64.b64encode(b"alice:nope").decode()},
                    {"authorization": "Basic %%%not-base64"}, {"authorization": "Bearer"}):  # fmt: skip
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401, (headers, r.status_code)
        challenges = _challenges(r)
        assert set(challenges) == {"bearer", "basic"}, r.headers
        assert 'realm="edit-rt"' in challenges["bearer"] and 'realm="edit-rt"' in challenges["basic"]
        assert r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(server, scheme):
    r = httpx.get(server.url + "/v1/models", headers={"authorization": scheme.encode() + b" " + TOKEN.encode()})
    assert r.status_code == 200, r.text


def test_webuiapi_set_auth_gets_in_with_basic(server, model_dir):
    import webuiapi

    api = webuiapi.WebUIApi(host="127.0.0.1", port=server.port)
    api.set_auth("alice", USERS["alice"])
    assert [m["model_name"] for m in api.get_sd_models()] == [model_dir.name]
    result = api.txt2img(prompt="a red circle", width=32, height=32, steps=2, seed=3)
    assert result.image.size == (32, 32)
    # every guarded path takes the same users, the second one's password colon and all
    for path in ("/v1/models", "/metrics", "/sdapi/v1/options"):
        assert httpx.get(server.url + path, auth=("bob", USERS["bob"])).status_code == 200, path
    for user, password in (("alice", "open sesam"), ("carol", "open sesame"), ("bob", "pa"), ("alice:open", "sesame")):
        assert httpx.get(server.url + "/sdapi/v1/sd-models", auth=(user, password)).status_code == 401, (user, password)
    assert httpx.get(server.url + "/health").status_code == 200  # not guarded


def test_basic_users_alone_take_basic_and_challenge_with_it_alone():
    from edit_rt.runtime.web.credentials import Credentials

    basic = lambda user_pass: b"Basic " + base64.b64encode(user_pass)  # noqa: E731
    alone = Credentials(None, "alice:open sesame,émile:mot:de passe")
    assert alone.required and [c.split()[0] for c in alone.challenges()] == ["Basic"]
    assert alone.accept(basic(b"alice:open sesame")) and alone.accept(b"basic  " + base64.b64encode("émile:mot:de passe".encode()))
    for header in (b"Bearer open sesame", b"Basic", basic(b"alice"), basic(b"alice:open sesame "), b"Basic \xff\xfe"):
        assert not alone.accept(header), header
    assert not Credentials(None, None).required


def test_api_auth_is_validated_naming_the_field_and_never_the_password(model_dir, onnx_dir, tmp_path):
    def config(api_auth):
        return config_from_dict({"model": str(model_dir), "build_dir": str(onnx_dir.parent.parent), "output_dir": str(tmp_path),
                                 "base": {"prompt": "x", "steps": 4, "width": 32, "height": 32}, "edits": [{"prompt": "y"}],
                                 "serve": {"api_auth": api_auth}})  # fmt: skip

    assert config("alice:s3cret,bob:x:y").serve.api_auth == "alice:s3cret,bob:x:y"
    for value in ("alices3cret", ":s3cret", "alice:s3cret,", "alice:s3cret, bob:x"):
        with pytest.raises(ConfigError) as err:
            config(value)
        message = str(err.value)
        assert message.startswith("serve.api_auth: ") and "user:password" in message and "s3cret" not in message, message


def test_the_environment_s_api_auth_is_checked_and_counts_as_authentication(server):
    r = serve_to_its_end(server.config, env={"EDIT_RT_API_AUTH": "alices3cret", "EDIT_RT_TOKEN": None})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: EDIT_RT_API_AUTH: ") and "user:password" in line and "s3cret" not in line
    # beyond loopback, Basic users are authentication enough (the port is the running server's: taken)
    r = serve_to_its_end(server.config, "--host", "0.0.0.0", env={"EDIT_RT_API_AUTH": "alice:x", "EDIT_RT_TOKEN": None})
    assert r.returncode == 2 and "no token is set" not in r.stderr and "is in use" in r.stderr, r.stderr


# --- metrics --------------------------------------------------------------------------------------


def _route_counts(url: str) -> dict[tuple[str, str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", headers=BEARER).text):
        for s in family.samples:
            if s.name == "edit_rt_http_request_seconds_count":
                counts[(s.labels["route"], s.labels["method"], s.labels["status"])] = s.value
    return counts


def test_metrics_label_every_request_by_its_route_template(server, served):
    before = _route_counts(server.url)
    sent = [
        ("GET", "/sdapi/v1/options", BEARER, ("/sdapi/v1/options", "GET", "200")),
        ("GET", "/sdapi/v1/progress", BEARER, ("/sdapi/v1/progress", "GET", "200")),
        ("POST", "/sdapi/v1/interrupt", BEARER, ("/sdapi/v1/interrupt", "POST", "200")),
        ("GET", "/sdapi/v1/loras", BEARER, ("/sdapi/v1/loras", "GET", "200")),
        ("GET", "/openapi.json", {}, ("/openapi.json", "GET", "200")),
        ("GET", "/docs/assets/favicon.png", {}, ("/docs/assets/{name}", "GET", "200")),
        ("DELETE", "/v1/bases/0123456789abcdef01234567", BEARER, ("/v1/bases/{bid}", "DELETE", "404")),
        # refused before routing: labelled by the template all the same
        ("PUT", "/sdapi/v1/options", BEARER, ("/sdapi/v1/options", "PUT", "405")),
        ("GET", "/sdapi/v1/options", {}, ("/sdapi/v1/options", "GET", "401")),
        ("GET", "/health", {"host": "evil.example"}, ("/health", "GET", "400")),
        ("POST", "/v1/images/generations", {**BEARER, "content-type": "text/plain"}, ("/v1/images/generations", "POST", "415")),
    ]
    for method, path, headers, _ in sent:
        # a body only where one is refused for its type; A1111's interrupt takes none
        httpx.request(method, server.url + path, headers=headers, content=b"x" if "content-type" in headers else None)
    for i in range(20):  # paths a client makes up: one label between them
        httpx.get(server.url + f"/v1/made-up-{i}", headers=BEARER)
        httpx.get(server.url + f"/nothing/{i}")
    after = _route_counts(server.url)
    for *_, key in sent:
        assert after.get(key, 0) - before.get(key, 0) == 1, (key, sorted(k for k in after if k[0] == key[0]))
    assert after[("unmatched", "GET", "404")] - before.get(("unmatched", "GET", "404"), 0) == 40
    routes = {route for route, _, _ in after}
    assert routes <= set(served) | {"unmatched"}, routes - set(served)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (.ci/run installs Debian's prometheus)")
def test_the_labelled_metrics_pass_promtool(server):
    text = httpx.get(server.url + "/metrics", headers=BEARER).text
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
