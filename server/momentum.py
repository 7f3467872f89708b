"""Server momentum (FedAvgM: Hsu, Qi and Brown 2019), in its heavy-ball form over the global models of the rounds:

    θ_r = θ_{r−1} + η·(merge_r − θ_{r−1}) + β·(θ_{r−1} − θ_{r−2})

η = 1, β = 0 is the merge itself. With η = 1 − β a steady update moves the model as the merge would, but each round's
step is the geometric mean of the last ~1/(1 − β) rounds' updates: under partial participation a round whose sampled
clients hold a few classes tilts the model by a tenth of its pull, not all of it. The state is the last step the
global model took, θ_{r−1} − θ_{r−2}, read off two consecutive global models (two checkpoints on resume), so a
resumed run steps bit for bit as the run it continues.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmc.core.state import State


@dataclass(frozen=True)
class ServerStep:
    """How the server moves the global model toward a round's merge: its learning rate η and momentum β."""

    lr: float = 1.0
    momentum: float = 0.0

    @property
    def plain(self) -> bool:
        """True where the new global model is the merge itself (η = 1, β = 0)."""
        return self.lr == 1.0 and self.momentum == 0.0

    def __call__(self, current: State, before: State | None, merged: State) -> State:
        """θ_r from the current global model θ_{r−1}, the one before it θ_{r−2} (None in round 1: no step yet) and
        the round's merge, all full width; float32, as the global model travels."""
        out = {}
        for name, theta in current.items():
            if not theta.is_floating_point():  # an index buffer: the merge's
                out[name] = merged[name]
                continue
            step = self.lr * (merged[name].float() - theta.float())
            if before is not None and self.momentum:
                step = step + self.momentum * (theta.float() - before[name].float())
            out[name] = (theta.float() + step).to(theta.dtype)
        return out


PLAIN = ServerStep()  # the merge itself: FedAvg's server step
