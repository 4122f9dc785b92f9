"""The export stage (`make export`, `make engines`, `edit-rt parity`): a diffusers model -> ONNX
graphs (the UNet split, fp16, LoRA slots), TensorRT plans and their parity against PyTorch, with
the model families and single-file checkpoints it reads. Imports torch, diffusers, onnx and
`runtime/`'s lower layers; no other folder of `export/`.
"""
