"""The Flower ServerApp and its symmetry-aware strategy. The flwr CLI imports this package in its own process: kept
light, it only lets `flwr run` check the run config before it submits a run (server/submission.py)."""

from server.submission import check_submission

check_submission()
