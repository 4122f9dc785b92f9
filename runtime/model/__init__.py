"""The edit model, no I/O: the strict field types (schema), an edit and a base and the one
edit -> row resolver (edit), the run config (config), what a base keeps (state), the DDIM
schedule, token alignment and attention-map masks.
"""
