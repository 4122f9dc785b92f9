"""The edit model, no I/O: the strict field types (schema), an edit and a base and the one
edit -> row resolver (edit), prompts (A1111's emphasis and LoRA tags, token alignment,
directions), the samplers (one file per algorithm), what a base keeps (state), LoRA adapters and
attention-map masks. Imports only runtime's root (errors.py).
"""
