"""The Flower ServerApp and its symmetry-aware strategy. Kept empty: the flwr CLI imports this package."""
