"""The pipeline layer: :class:`~edit_rt.runtime.pipeline.edit_pipeline.EditPipeline` (generate,
invert, tail on the step loop), composed of its prompts' K/V (`text.py`), what an edit keeps of
its base (`preserve.py`), its autoencoders (`decoders.py`) and what fits in memory per size
(`memory_fit.py`); its assembly from a run config (`assemble.py`), the images it takes and gives
(`images.py`, `uploads.py`, `pnginfo.py`) and a config's catalogue run chunk by chunk (`catalogue.py`).
Imports the layers below it (model, config, engine, loop, storage); never serving, web or apps.
"""
