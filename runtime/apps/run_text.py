"""`edit-rt run CONFIG` for a text config (``text:``, config/text.py): the prompt's continuations as
one batch (rows of one text sharing its cache), then each span edit of the first continuation as
one batch, every token outside the span kept, then (``text.style``) a style pass over every
continuation as one batch (pipeline/text_pipeline.py).

Writes to ``output_dir``: ``text.json`` (every row's text, finish reason, tokens; every edit's
span and text; graph calls, tokens per call, seconds) and one ``row-<k>.txt`` / ``edit-<k>.txt``
/ ``style-<k>.txt`` per text (the prompt and its continuation)."""

from __future__ import annotations

import json
from typing import Any

from ..config.text import TextRunConfig
from ..pipeline.text_pipeline import Decoding, Row, Style, TextPipeline
from .run import Timer, output_errors, writable_or_refuse


def run_text(cfg: TextRunConfig) -> dict[str, Any]:
    """Continue ``cfg``'s prompt, edit the first continuation's spans; return the report (also text.json)."""
    t = cfg.text
    writable_or_refuse(cfg.output_dir, "output_dir")
    timer = Timer()
    decoding = Decoding.of(t)
    with timer.stage("load"), TextPipeline.from_config(cfg) as pipe:
        with timer.stage("continuations"):
            result = pipe.complete(t.prompt, t.max_tokens, decoding=decoding, stop=t.stop,
                                   rows=[Row(r.seed, r.temperature, r.instruction) for r in t.rows])  # fmt: skip
        edits = []
        with timer.stage("edits"):
            for k, edit in enumerate(t.edits):
                if edit.tokens is not None:
                    span = tuple(edit.tokens)
                else:
                    span = pipe.line_span(result, 0, tuple(edit.lines), f"text.edits[{k}].lines")
                edited = pipe.span_edit(result, 0, span, decoding, seeds=[edit.seed], temperature=edit.temperature, stop=t.stop)
                edits.append({"edit": k, "span_tokens": list(span), "text": edited.texts[0], "forwards": edited.stats.forwards,
                              "decoded": edited.stats.decoded, "edited": edited.stats.edited, "seconds": round(edited.seconds, 4),
                              "file": f"edit-{k}.txt", "_full": pipe.decode(edited.ids[0][: edited.starts[0] + edited.tokens[0]])})  # fmt: skip
        styled = []
        if t.style is not None:
            with timer.stage("style"):
                s = t.style
                done = pipe.style_pass(result, Style(s.edit_threshold, s.rounds, s.groups, s.cache, s.instruction), stop=t.stop)
            styled = [{"row": k, "text": done.texts[k], "changed": int((done.ids[k] != result.ids[k]).sum()), "file": f"style-{k}.txt",
                       "_full": pipe.decode(done.ids[k][: done.starts[k]]) + done.texts[k]} for k in range(len(t.rows))]  # fmt: skip
            style_calls = {"forwards": done.stats.forwards, "edited": done.stats.edited}
        kind, backend = pipe.manifest.kind, pipe.backend
        rows = [{"row": k, "seed": r.seed, "temperature": t.temperature if r.temperature is None else r.temperature,
                 "instruction": r.instruction, "text": result.texts[k], "finish_reason": result.finish_reasons[k],
                 "tokens": result.tokens[k], "file": f"row-{k}.txt",
                 "_full": pipe.decode(result.ids[k][: result.starts[k]]) + result.texts[k]} for k, r in enumerate(t.rows)]  # fmt: skip
    report = {"config": str(cfg.source) if cfg.source else None, "model": str(cfg.model), "kind": kind, "backend": backend,
              "prompt": t.prompt, "rows": rows, "edits": edits, "style": styled,
              "calls": {"forwards": result.stats.forwards, "decoded": result.stats.decoded, "edited": result.stats.edited,
                        "tokens_per_forward": result.stats.tokens_per_forward()},
              "seconds": timer.stages}  # fmt: skip
    if styled:
        report["calls"]["style"] = style_calls
    with output_errors(cfg.output_dir):
        for item in [*rows, *edits, *styled]:
            (cfg.output_dir / item["file"]).write_text(item.pop("_full"))
        (cfg.output_dir / "text.json").write_text(json.dumps(report, indent=2))
    return report
