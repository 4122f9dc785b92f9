"""The service: the domain operations every door uses (generate, edit, invert, store), and how
their errors answer over HTTP (http_errors). Imports the pipeline and every layer below it;
never web, scale or apps.
"""
