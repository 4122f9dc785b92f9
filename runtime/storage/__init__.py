"""The base-state store: RAM and disk tiers, the file codec, the shared folder, the stored bases by
prompt embedding. Imports the edit model and runtime's root.
"""
