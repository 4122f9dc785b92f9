"""Speed, measured (`make bench`, `make related`, `make bench-samplers`): throughput against
diffusers, the side measurements, the CPU engines side by side (`make bench-engines`), sliders and
samplers at equal quality, and the related-generations workload with its replay and embedding
study. Imports every other folder of
`export/` and `runtime/` (an in-process server included).
"""
