"""The run config: one YAML file, typed and checked at load (`run_config.py`: `RunConfig`,
`load_config`), and its sections that have a file of their own (`serve.py` the server's `serve:`,
`catalogue.py` a catalogue's spec). Imports the edit model (`model/`) only.
"""
