"""The service: the domain operations every door uses (generate, edit, invert, store), metrics.
"""
