"""Who may call the guarded routes (``/v1/*``, ``/sdapi/*``, ``/metrics``): the bearer token and
AUTOMATIC1111-style HTTP Basic users, as clients send them (server.py's guard asks :meth:`Credentials.accept`).

- **Bearer** (RFC 6750): ``serve.token`` or ``EDIT_RT_TOKEN``; what the openai SDK sends.
- **Basic** (RFC 7617): ``serve.api_auth`` or ``EDIT_RT_API_AUTH``, ``user:password`` pairs as
  A1111's ``--api-auth`` takes them; what webuiapi's ``set_auth`` sends.

The scheme word is case-insensitive (RFC 7235: ``bearer x`` is ``Bearer x``). The credential is
compared as bytes in constant time (``secrets.compare_digest``; the token and the users as
UTF-8, so non-ASCII ones work), against every user, so the time says nothing of which one came
close. A 401 names the schemes this server takes in ``WWW-Authenticate``, one header each (a
browser reads one challenge per header), with realm ``edit-rt``.
"""

from __future__ import annotations

import base64
import binascii
import os
import secrets
from typing import Optional

from ..config.serve import Serve, api_auth_pairs, token_refusal
from ..errors import ConfigError

REALM = "edit-rt"


def api_auth_of(serve: Serve) -> Optional[str]:
    """The Basic users in force: ``EDIT_RT_API_AUTH`` over ``serve.api_auth`` (as EDIT_RT_TOKEN
    over serve.token), the environment's checked as the config's is, naming the variable."""
    value = os.environ.get("EDIT_RT_API_AUTH")
    if not value:
        return serve.api_auth
    try:
        api_auth_pairs(value)
    except ValueError as err:
        raise ConfigError(f"EDIT_RT_API_AUTH: {err}") from None
    return value


def token_of(serve: Serve) -> Optional[str]:
    """The bearer token in force: ``EDIT_RT_TOKEN`` over ``serve.token`` (an empty variable is
    unset), the environment's refused as the config's is (blank, surrounding whitespace: no
    client could send it), naming the variable and the fix, before the server starts."""
    value = os.environ.get("EDIT_RT_TOKEN")
    if not value:
        return serve.token
    refusal = token_refusal(value, "unset EDIT_RT_TOKEN (serve.token then applies)")
    if refusal is not None:
        raise ConfigError(f"EDIT_RT_TOKEN: {refusal}")
    return value


class Credentials:
    """The bearer token and the Basic users a request may show; none set: every request passes."""

    def __init__(self, token: Optional[str], api_auth: Optional[str]):
        self.token: Optional[bytes] = token.encode("utf-8") if token else None
        # RFC 7617's user-pass, "user:password", as a client's Basic credential decodes
        pairs = api_auth_pairs(api_auth) if api_auth else []
        self.users: list[bytes] = [f"{user}:{password}".encode("utf-8") for user, password in pairs]

    @property
    def required(self) -> bool:
        return self.token is not None or bool(self.users)

    def accept(self, authorization: bytes) -> bool:
        """Whether an ``Authorization`` header's raw bytes show the token or one of the users."""
        scheme, _, credential = authorization.partition(b" ")
        credential = credential.lstrip(b" ")  # RFC 7235: 1*SP after the scheme
        scheme = scheme.lower()
        if scheme == b"bearer" and self.token is not None:
            return secrets.compare_digest(credential, self.token)
        if scheme == b"basic" and self.users:
            try:
                given = base64.b64decode(credential, validate=True)
            except (binascii.Error, ValueError):
                return False
            # every user compared, none skipped: how long it takes does not say which one matched
            return sum(secrets.compare_digest(given, user) for user in self.users) > 0
        return False

    def wanted(self) -> str:
        """A 401's message: what was missing or wrong."""
        kinds = (["bearer token"] if self.token is not None else []) + (["HTTP Basic user:password"] if self.users else [])
        return f"missing or wrong {' or '.join(kinds)}"

    def challenges(self) -> list[str]:
        """A 401's ``WWW-Authenticate`` values: one per scheme taken."""
        found = [f'Bearer realm="{REALM}"'] if self.token is not None else []
        if self.users:
            found.append(f'Basic realm="{REALM}", charset="UTF-8"')
        return found
