"""The pipeline layer: :class:`~edit_rt.runtime.pipeline.edit_pipeline.EditPipeline` (generate,
invert, tail, decode on the step loop), its prompts (`text.py`), its assembly from a run config
(`assemble.py`), the images it takes and gives (`images.py`, `uploads.py`, `pnginfo.py`) and a
config's catalogue run chunk by chunk (`catalogue.py`).
Imports the layers below it (model, config, engine, loop, storage); never serving, web or apps.
"""
