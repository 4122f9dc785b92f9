"""Who may reach a server's port: one beyond loopback needs credentials, or is refused.

Without a bearer token or HTTP Basic users (credentials.py), anyone who reaches a port beyond
loopback drives the engines (a GPU, for as long as they like) and fills the store's disk. A
server is started there only where its launcher says something in front of it checks who
connects (`edit-rt serve --allow-no-token`), and then says so loudly. Both launchers ask
this before they bind (``server.serve`` and Ray's ``serve_forever``, whoever calls them: the CLI
passes its flag through), so no road opens such a port.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Union

from ..config.serve import Serve
from ..errors import ConfigError
from .credentials import api_auth_of, token_of
from .request_checks import LOOPBACK_HOSTS


def refuse_an_open_port(serve: Serve, source: Union[Path, str], allow_no_token: bool, say: Callable[[str], None]) -> None:
    """Raise ConfigError (naming ``source``, the config file, and each fix) where ``serve``
    listens beyond loopback with neither a token nor Basic users and ``allow_no_token`` is
    false; where it is true, ``say`` a warning instead. ``EDIT_RT_TOKEN`` and
    ``EDIT_RT_API_AUTH`` count, and are checked here on every host (one no client could send is
    refused, loopback too), before anything is said or bound."""
    token, api_auth = token_of(serve), api_auth_of(serve)
    if serve.host in LOOPBACK_HOSTS or token or api_auth:
        return
    if not allow_no_token:
        raise ConfigError(f"serve.host: {serve.host} is not loopback and no token is set, so anyone who reaches port "
                          f"{serve.port} could run the engines and fill the store; set serve.token (or serve.api_auth's "
                          f"user:password) in {source}, or EDIT_RT_TOKEN, or pass --allow-no-token if something "
                          "in front of it authenticates")  # fmt: skip
    say(f"edit-rt serve: WARNING: listening on {serve.host} without a token (--allow-no-token): every client "
        f"that reaches port {serve.port} can use the API")  # fmt: skip
