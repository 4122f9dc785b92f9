"""The step loop: rows, the resident-slot scheduler (slots), the queue around it (batcher, which
takes rows from a resolver and never imports the pipeline), jobs and the resolver. Imports the
engine layer, the edit model and runtime's root.
"""
