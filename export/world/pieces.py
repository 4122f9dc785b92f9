"""A training run cut into pieces that fit one session (the planner's, the text models'): a
checkpoint folder holding the run's spec and state, a clock that counts every earlier piece, a
piece's own minutes, the run's budget, and why the run stopped.

    pieces = Pieces.open(checkpoint, asdict(spec), piece_minutes, spec.max_minutes, spec.checkpoint_every, say)
    if pieces.state_file is not None and pieces.state_file.exists():
        ...load...; pieces.resumed(spent)
    for step in range(first, spec.steps):
        if pieces.stop_before(step, first, save_state):
            break
        ...one step...
    pieces.end(len(history), first, save_state)   # the checkpoint then holds the finished run

``pieces.ended``: ``"steps"`` (every step run), ``"budget"`` (the run's minutes spent: it is over,
a run again would stop at once) or ``"piece"`` (this piece's minutes spent: run again to resume).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

ENDS = ("steps", "budget", "piece")


class Pieces:
    def __init__(self, state_file: Optional[Path], piece_minutes: float, max_minutes: float, checkpoint_every: int,
                 say: Callable[[str], None] = print):  # fmt: skip
        self.state_file = state_file
        self.piece_minutes, self.max_minutes, self.checkpoint_every = piece_minutes, max_minutes, checkpoint_every
        self.say = say
        self.run_start = time.perf_counter()  # this piece's
        self.start = self.run_start  # the run's: earlier pieces' seconds before it once resumed
        self.ended = "steps"

    @classmethod
    def open(cls, checkpoint: Optional[Path], spec: dict, piece_minutes: float, max_minutes: float, checkpoint_every: int,
             say: Callable[[str], None] = print, defaults: Optional[dict] = None) -> "Pieces":  # fmt: skip
        """``checkpoint`` (None: one uncut run) made or checked to hold a run of ``spec``; a field
        added to the spec since the folder's marker was written counts at its value in ``defaults``."""
        if checkpoint is None:
            return cls(None, piece_minutes, max_minutes, checkpoint_every, say)
        checkpoint = Path(checkpoint)
        checkpoint.mkdir(parents=True, exist_ok=True)
        marker = checkpoint / "spec.json"
        if marker.exists() and {**(defaults or {}), **json.loads(marker.read_text())} != json.loads(json.dumps(spec)):
            raise ValueError(f"{checkpoint} holds a run of another spec ({marker}); give another --checkpoint folder or delete it")
        marker.write_text(json.dumps(spec))
        return cls(checkpoint / "state.pt", piece_minutes, max_minutes, checkpoint_every, say)

    @property
    def finished(self) -> bool:
        """Whether the run is over (every step, or its budget): only a piece's end resumes."""
        return self.ended != "piece"

    def resumed(self, spent: float) -> None:
        """The run resumed from a state that had run ``spent`` seconds."""
        self.start = time.perf_counter() - spent

    def seconds(self) -> float:
        """The run's seconds so far, every piece's."""
        return time.perf_counter() - self.start

    def stop_before(self, step: int, first: int, save: Callable[[int], None]) -> bool:
        """Whether the run stops before ``step`` (``first``: this piece's first); saves the state
        every ``checkpoint_every`` steps and at a piece's end."""
        if self.max_minutes and self.seconds() > 60 * self.max_minutes:
            self.ended = "budget"
            self.say(f"time budget of {self.max_minutes} min spent after {step} steps")
            return True
        if self.state_file is not None and step > first:
            if self.piece_minutes and time.perf_counter() - self.run_start > 60 * self.piece_minutes:
                save(step)
                self.ended = "piece"
                self.say(f"this piece's {self.piece_minutes} min spent at step {step}: saved {self.state_file}; run again to resume")
                return True
            if step % self.checkpoint_every == 0:
                save(step)
        return False

    def end(self, steps_run: int, first: int, save: Callable[[int], None]) -> None:
        """After the loop: a run that is over saves its last state too (the checkpoint then holds it)."""
        if self.state_file is not None and self.finished and steps_run > first:
            save(steps_run)
