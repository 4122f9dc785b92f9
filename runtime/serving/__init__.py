"""The service: the domain operations every door uses (generate, edit, invert, the store's, job
control), composed by :class:`~edit_rt.runtime.serving.service.Service`. Its refusals are the
domain errors of runtime/errors.py; it knows no HTTP. Imports the pipeline and every layer below
it; never web, scale or apps.
"""
