"""The applications on top of the runtime: `edit-rt run` (`run.py`), the
Python API (`editor.py`) and the CLI (`cli.py`, `progress.py`). Nothing imports them but each
other; `cli.py` is the one module that loads `export/` (by name, for the commands that need
torch).
"""
