"""One-off analyses: each answered one question that a page of docs/ cites with its figures (where a barrier comes
from, what weight matching's options, starts and residual map are worth, how much learning helps, what the audit of
hostile replies found, which data-free step helps a one-shot merge). Most measure the barrier bench's seeds from its
config's tables (``simulations/bench/configs/barriers.toml``); ``weight_options`` reads its own configs in
``configs/``. Each publishes to ``simulations/results/``; an analysis that the docs no longer cite is removed with
its config and results."""
