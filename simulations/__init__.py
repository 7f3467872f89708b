"""Experiments that drive glmc and the Flower apps, each from a committed config and one command:

- ``compare.py``: the FL experiment grid (``python -m simulations.compare --config simulations/configs/NAME.toml``),
  with ``configs/`` its grids and ``attack_table.py`` the attack grids' table;
- ``bench/``: the product benchmarks, which measure what glmc and the apps promise (barriers, merging, families,
  scaling, precision, accelerators, one attacker), with their configs and support modules;
- ``analyses/``: one-off analyses that answered a question the docs cite, with their own configs; they may import
  a bench's helpers, a bench never imports them;
- ``results/``: what each published, command and machine included; ``fixtures/``: the official GLMC GPT-2 pair.

The engine they run flwr through and the config reader are :mod:`harness`'s, shared with ``deploy``.
"""
