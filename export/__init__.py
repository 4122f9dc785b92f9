"""The torch world: builds edit-rt's artifacts, and makes and measures its models. Four stages,
each a folder that imports only the ones before it (pyproject.toml's [tool.importlinter]):

- ``compile/``: the export stage of the design card (`make export`, `make engines`, parity);
- ``world/``: the shapes world, its trainers and the random models;
- ``eval/``: quality (`make quality`, the gates);
- ``bench/``: speed (`make bench`, `make related`, `make bench-samplers`).

Any of them may import ``runtime/``'s layers below its applications (``runtime/apps/``, whose
CLI loads these folders by name); ``runtime/`` never imports ``export/``. ``models/`` and
``checkpoints/`` hold the committed models and the state a cut training resumes from.
"""
