"""The vocabulary every other package of glmc speaks: model configs, state dicts and the symmetry spec's
axis kinds. It imports nothing else of glmc but its errors."""
