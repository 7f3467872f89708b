"""TEST HOOK: well-formed hostile replies, for the attack benchmark (simulations/configs/attacks.toml) and the fuzzer.

One partition (``attack-partition``) trains as usual, then turns its reply into an attack (``attack``). Every
attack passes validation: the arrays keep their keys, dtype and shape, and the metrics stay positive and finite.

- ``inflate``: claims 10⁹ training examples (the validation cap) for an honest model.
- ``scale``: its weights multiplied by 1000 (each value stays under the per-element bound of 1e4 for these models).
- ``signflip``: its update reversed and boosted: g − n·(θ − g), with n the number of partitions.
- ``replace``: model replacement (Bagdasaryan et al., 2020): g + n·(t − g), t a freshly initialised model.
- ``constant``: every tensor 9999 (it crashed the ServerApp under weight aggregation before the defences).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from federation import protocol
from glmc.archs import build_model
from glmc.core.config import ModelConfig
from glmc.core.state import cast
from glmc.train import seed_everything

INFLATED_EXAMPLES = 10**9
SCALE = 1000.0
CONSTANT = 9999.0

State = dict[str, torch.Tensor]


def attack(kind: str, trained: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor], cfg: ModelConfig,
           boost: float, seed: int) -> tuple[State, dict[str, float]]:
    """(the reply's state, the metric values it overrides) of attack ``kind``; ``received`` is the global model as
    this client got it, ``boost`` the factor of signflip and replace."""
    state = {k: v.detach().to(torch.float32) for k, v in trained.items()}
    if kind == "inflate":
        return state, {protocol.WEIGHT_KEY: INFLATED_EXAMPLES}
    if kind == "scale":
        return {k: SCALE * v for k, v in state.items()}, {}
    if kind == "signflip":
        return {k: received[k] - boost * (v - received[k]) for k, v in state.items()}, {}
    if kind == "replace":
        seed_everything(seed)
        target = cast(build_model(cfg).state_dict(), torch.float32)
        return {k: received[k] + boost * (target[k] - received[k]) for k in state}, {}
    if kind == "constant":
        return {k: torch.full_like(v, CONSTANT) for k, v in state.items()}, {}
    return state, {}
