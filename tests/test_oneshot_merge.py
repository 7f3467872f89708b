"""The data-free one-shot merge bench's class-weighted head, on states it did not make."""

from __future__ import annotations

import torch

from simulations.analyses.oneshot_merge import class_weighted_head


def test_each_class_row_comes_from_the_clients_that_saw_it_in_proportion() -> None:
    torch.manual_seed(0)
    clients = [{"head.w": torch.randn(3, 4, dtype=torch.float64), "head.b": torch.randn(3, dtype=torch.float64),
                "blocks.0.mlp.fc1.w": torch.randn(2, 2, dtype=torch.float64)} for _ in range(2)]
    merged = {k: (clients[0][k] + clients[1][k]) / 2 for k in clients[0]}
    counts = [[10, 0, 30], [0, 5, 10]]  # client 0 never saw class 1, client 1 never saw class 0
    out = class_weighted_head(merged, clients, counts)
    for key in ("head.w", "head.b"):
        torch.testing.assert_close(out[key][0], clients[0][key][0])
        torch.testing.assert_close(out[key][1], clients[1][key][1])
        torch.testing.assert_close(out[key][2], 0.75 * clients[0][key][2] + 0.25 * clients[1][key][2])
    assert out["blocks.0.mlp.fc1.w"] is merged["blocks.0.mlp.fc1.w"]  # the rest of the merge is untouched
