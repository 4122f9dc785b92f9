"""`edit-rt ARGS` in this process, as the console script runs it: through ``cli.main`` (its one
``error:`` line, its exit status), in typer's CliRunner isolation (stdout, stderr and the
environment swapped for the call), without an interpreter's start or the imports a subprocess
pays again. Where a real process matters (an installed script, a signal, a fresh interpreter's
imports), tests/server_process.py launches one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from typer.testing import CliRunner

from edit_rt.runtime.apps import cli


@dataclass
class Ran:
    """What a command left: its exit status and its two streams, as text."""

    returncode: int
    stdout: str
    stderr: str


def edit_rt(*args: str, env: dict | None = None) -> Ran:
    """Run `edit-rt ARGS`; ``env`` is laid over the environment for the call (None: unset)."""
    with CliRunner().isolation(env=env) as (stdout, stderr, _output):
        try:
            cli.main(list(args))
            code = 0
        except SystemExit as end:
            code = end.code
        finally:
            sys.stdout.flush()  # the isolation's text wrappers over the bytes read here
            sys.stderr.flush()
        return Ran(code, stdout.getvalue().decode(), stderr.getvalue().decode())
