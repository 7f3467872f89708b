"""The product benchmarks: barriers and timing of the symmetry core (``barriers``, on given pairs through
``pair_rows``, the official pair in ``official``), merging N models (``merging``), every declared family
(``families``), matching against model size (``scaling``, with ``planting``'s hand-planted transforms) and through
``glmc align`` from bfloat16 folders (``precision``), accelerators (``accelerator``, and ``gpu_session``, which runs a
lent GPU machine's session), and one attacker among honest clients (``single_attacker``, with ``attack_clients``).
Configs in ``configs/``; each publishes to ``simulations/results/``."""
