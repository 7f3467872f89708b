"""The repository's own tooling, below the experiments and the deployment that use it: the code that drives flwr for
them, and the generator of the docs pages written from the sources.

- ``engine.py``: `flwr run` from Python (a local SuperLink, a run's status, the processes it started). The
  experiment grid (``simulations.compare``) runs every cell through it, and ``deploy`` runs its gRPC federations
  through it, so it lives in neither: deploy needs the engine, not the experiments.
- ``tomlfile.py``: a config read, or refused in one line (the grid, the benches, the analyses).
- ``docs.py`` with ``results_doc.py``: ``docs/cli.md``, ``run-config.md``, ``registry.md`` and ``results.md``, from
  glmc's command line, federation's run config and registries, and the committed ``simulations/results/``.

It imports glmc and federation only, never ``simulations`` or ``deploy`` (tests/test_layout.py checks it), so
importing the engine loads no bench. The results page is the one place that reads experiment code: each results
folder's tables are rendered by the module that published them, so that the page cannot drift from the code that
measured it; ``results_doc`` names that module for each folder and loads it by name when the page is written, as
a documentation tool loads the code it documents.
"""
