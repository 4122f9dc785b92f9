"""Every number the `edit-rt` commands take has both bounds, refused before any work as one
line naming the option and the bound (issue 50, item 5), and a bearer token no client could
send is refused at startup (item 7).

In-process: typer's CliRunner runs the commands (usage errors are exit 2), and `main()` (the
console script) inside its isolation shows the one `error:` line. The options are enumerated
from the typer app's click commands, so a new numeric option without a bound fails here; the
reference for a bound is click's own parameter metadata (min/max), or for a list option what
its message says, held to what the command then accepts. The token's reference is h11 (the
HTTP/1.1 parser under uvicorn): what a header value holding the token arrives as.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import h11
import pytest
import typer
import typer.main
import yaml
from typer.testing import CliRunner

from edit_rt.runtime.apps import cli
from edit_rt.runtime.config.load import config_from_dict
from edit_rt.runtime.config.serve import Serve
from edit_rt.runtime.errors import ConfigError, EditRtError
from edit_rt.runtime.web.credentials import Credentials, token_of

NUMBERS = re.compile(r"-?\d+(\.\d+)?")


def _said(result) -> str:
    """typer's boxed usage error as one line of words (the box wraps at 80 columns)."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


def _numeric_list(default) -> bool:
    return isinstance(default, str) and all(NUMBERS.fullmatch(v) for v in default.split(","))


def numeric_options(app: typer.Typer) -> list[tuple[str, object]]:
    """(command, parameter) of every number a command takes: an int or float option or
    argument, or a comma-separated list whose default is numbers."""
    found = []
    for name, command in typer.main.get_command(app).commands.items():
        for param in command.params:
            annotation = param.type_descriptor.annotation
            if annotation in (int, float) or _numeric_list(param.default):
                found.append((name, param))
    return found


OPTIONS = numeric_options(cli.app)


@pytest.fixture
def stops_early(tmp_path):
    """Arguments that make each command stop at its first check after parsing (a config file
    that does not exist; for `model`, an --out that is a file), so that an accepted value shows
    as that check's EditRtError instead of minutes of work."""
    taken = tmp_path / "taken"
    taken.write_text("a file")

    def args(command: str) -> list[str]:
        click_command = typer.main.get_command(cli.app).commands[command]
        out = [str(tmp_path / "missing.yaml") for p in click_command.params if p.param_type_name == "argument"]
        if any("--out" in p.opts for p in click_command.params):
            out += ["--out", str(taken)]
        return out

    return args


def _invoke(command: str, *args: str):
    return CliRunner().invoke(cli.app, [command, *args])


def _refused(result, *needles: str) -> str:
    said = _said(result)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    for needle in needles:
        assert needle in said, said
    return said


def _accepted(result) -> None:
    """Past the option's check: the command stopped at its own first check (stops_early)."""
    assert isinstance(result.exception, EditRtError), (result.exit_code, result.output, result.exception)


def test_the_enumeration_finds_every_numeric_option_and_would_flag_an_unbounded_one():
    names = {(command, param.opts[0]) for command, param in OPTIONS}
    assert {("bench", "--ns"), ("bench", "--fractions"), ("bench", "--repeats"), ("quality", "--bases"),
            ("gates", "--prompts"), ("gates", "--bases"), ("serve", "--port"), ("model", "--seed")} <= names  # fmt: skip
    spare = typer.Typer()

    @spare.command()
    def work(count: int = typer.Option(3), level: float = typer.Option(0.5, min=0), sizes: str = "1,2") -> None:
        """A new command's numbers, declared without bounds."""

    @spare.command()
    def other() -> None:
        """A second command, so that typer keeps them as subcommands."""

    params = {p.opts[0]: p for _, p in numeric_options(spare)}
    assert set(params) == {"--count", "--level", "--sizes"}
    assert params["--count"].max is None and params["--level"].max is None  # what the test below refuses


def test_a_billion_edit_batch_is_refused_at_once_naming_ns_and_its_bound(tmp_path):
    """`bench --ns 1000000000` allocated until a MemoryError (~60 s): now a usage error before
    the config is even read (it does not exist here, and the refusal is about --ns)."""
    result = _invoke("bench", str(tmp_path / "missing.yaml"), "--ns", "1000000000")
    said = _refused(result, "--ns", "[1, 1024]")
    assert "missing.yaml" not in said
    code, lines = _main("bench", str(tmp_path / "missing.yaml"), "--ns", "1000000000")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: Invalid value for '--ns'") and "1024" in lines[0]


@pytest.mark.parametrize("command,param", OPTIONS, ids=[f"{c} {p.opts[0]}" for c, p in OPTIONS])
def test_every_numeric_option_has_a_bound_checked_before_work(command, param, stops_early):
    option = param.opts[0]
    args = stops_early(command)
    if not _numeric_list(param.default):
        assert param.min is not None and param.max is not None, f"{command} {option}: declare min= and max="
        step = 1 if param.type_descriptor.annotation is int else 0.5
        _refused(_invoke(command, *args, option, str(param.max + step)), option, str(param.max))
        _refused(_invoke(command, *args, option, str(param.min - step)), option, str(param.min))
        _refused(_invoke(command, *args, option, str(10**30)), option)  # past every bound (a 100-bit number)
        _accepted(_invoke(command, *args, option, str(param.max)))
        _accepted(_invoke(command, *args, option, str(param.min)))
        return
    # a list: its message says the bounds; the command holds to them
    said = _refused(_invoke(command, *args, option, "1000000000"), option)
    low_bracket, low, high, high_bracket = re.search(r"([\[(])(-?[\d.]+), (-?[\d.]+)([\])])", said).groups()
    count = int(re.search(r"at most (\d+)", said).group(1))
    assert high_bracket == "]"
    _accepted(_invoke(command, *args, option, ",".join([high] * count)))
    _refused(_invoke(command, *args, option, ",".join([high] * (count + 1))), option)
    number = float if "." in high + low else int
    _refused(_invoke(command, *args, option, str(number(high) + 1)), option)
    _refused(_invoke(command, *args, option, low if low_bracket == "(" else str(number(low) - 1)), option)


# --- the bearer token -----------------------------------------------------------------------------


def _arrives(token: str) -> bytes:
    """The Authorization value a server's h11 hands on when a client sends ``Bearer <token>``."""
    server = h11.Connection(h11.SERVER)
    server.receive_data(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token.encode() + b"\r\n\r\n")
    return dict(server.next_event().headers)[b"authorization"]


UNSENDABLE = [" ", "\t", "  ", "secret ", " secret", "secret\t"]


@pytest.mark.parametrize("token", UNSENDABLE)
def test_a_token_no_client_can_send_is_refused_from_the_environment(monkeypatch, token):
    arrived = _arrives(token)
    assert not Credentials(token, None).accept(arrived)  # the reason: what arrives never matches
    monkeypatch.setenv("EDIT_RT_TOKEN", token)
    with pytest.raises(ConfigError) as err:
        token_of(Serve())
    message = str(err.value)
    assert message.startswith("EDIT_RT_TOKEN: ") and "\n" not in message
    assert "unset EDIT_RT_TOKEN" in message or "remove the surrounding whitespace" in message


@pytest.mark.parametrize("token", UNSENDABLE)
def test_a_token_no_client_can_send_is_refused_in_the_config(token):
    base = {"prompt": "x", "steps": 4, "width": 32, "height": 32}
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": "m", "base": base, "serve": {"token": token}}, source=Path("c.yaml"))
    assert str(err.value).startswith("c.yaml: serve.token: ") and "\n" not in str(err.value)


@pytest.mark.parametrize("token", ["secret", "two words", "ünïcode-tøken"])
def test_a_token_a_client_can_send_is_kept(monkeypatch, token):
    assert Credentials(token, None).accept(_arrives(token))
    monkeypatch.setenv("EDIT_RT_TOKEN", token)
    assert token_of(Serve(token="from-config")) == token
    monkeypatch.setenv("EDIT_RT_TOKEN", "")  # an empty variable is unset: the config's applies
    assert token_of(Serve(token="from-config")) == "from-config"


def _main(*args: str, env: dict | None = None) -> tuple[int, list[str]]:
    """`edit-rt ARGS` through the console script's own entry point, in CliRunner's isolation:
    its exit status and its stderr lines."""
    with CliRunner().isolation(env=env) as (_, stderr, _output):
        argv, sys.argv = sys.argv, ["edit-rt", *args]
        try:
            cli.main()
            code = 0
        except SystemExit as end:
            code = end.code
        finally:
            sys.argv = argv
            sys.stderr.flush()  # the isolation's text wrapper over the bytes read here
        return code, stderr.getvalue().decode().splitlines()


def test_serve_with_a_blank_token_exits_2_in_one_line_before_it_starts(tmp_path, monkeypatch):
    def bound(*args, **kwargs):
        raise AssertionError("the server bound its port")

    monkeypatch.setattr("edit_rt.runtime.web.http_server.listening_sockets", bound)  # serve() binds first
    monkeypatch.delenv("EDIT_RT_TOKEN", raising=False)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": str(tmp_path / "no-model"), "build_dir": str(tmp_path / "build"),
                                      "base": {"prompt": "x", "steps": 4, "width": 32, "height": 32}}))  # fmt: skip
    code, lines = _main("serve", str(config), env={"EDIT_RT_TOKEN": " "})
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: EDIT_RT_TOKEN: blank"), lines
    config.write_text(config.read_text() + "serve: {token: ' secret'}\n")
    code, lines = _main("serve", str(config))
    assert code == 2 and len(lines) == 1 and "serve.token: starts or ends with whitespace" in lines[0], lines


def test_a_token_with_a_control_character_is_refused(monkeypatch):
    with pytest.raises(h11.RemoteProtocolError):  # a header cannot even carry it
        _arrives("line\nbreak")
    monkeypatch.setenv("EDIT_RT_TOKEN", "line\nbreak")
    with pytest.raises(ConfigError, match="^EDIT_RT_TOKEN: holds a control character"):
        token_of(Serve())
