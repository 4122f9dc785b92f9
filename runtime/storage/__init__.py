"""The base-state store: RAM and disk tiers, the file codec, the shared folder.
"""
