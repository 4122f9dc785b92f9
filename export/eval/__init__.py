"""Quality, measured (`make quality`, `edit-rt gates`): the judges that read an edit in each world,
the targets and gates, the prompt-to-prompt baseline and the sliders' evaluation. Imports
`compile/`, `world/` and `runtime/`'s lower layers.
"""
