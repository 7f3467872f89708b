"""Ways to estimate the transform that brings model B next to model A: weight, activation (and learned) matching."""
