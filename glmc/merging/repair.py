"""REPAIR (Jordan et al., 2022) for a merge: reset each merged unit's activation statistics to its inputs'.

Averaging units that are only approximately aligned cancels their misaligned parts, so the merged model's
pre-activations shrink and drift (the "variance collapse"). REPAIR measures, on a few training inputs, each
output channel's mean and standard deviation in every input model and in the merged model, and rescales and
shifts the merged layer's row ``[w | b]`` so that its channel has the inputs' weighted mean statistics. Layers are
repaired in forward order, each measured after the ones before it were repaired. Unlike :mod:`glmc.merging.rescale`, it
needs data, and the merged model's function changes (that is its purpose); the inputs are only read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

from glmc.archs import get_arch
from glmc.core.config import ModelConfig
from glmc.core.spec import MLP, RES, block_linears
from glmc.core.state import State
from glmc.data.tasks import inputs_of
from glmc.errors import ConfigError
from glmc.merging.activations import AllSitesRecorded, Hook, hooked_passes
from glmc.symmetry.canonical import to_model

# The linear layers whose output channels are repaired, block by block in forward order: those whose output is the
# MLP's units (fc1; a gated MLP's ``up``) or the residual stream (its writers). Not q and k: they act only through
# their product, which per-channel moments do not describe; on 5 vit-bench seeds, adding qkv cost 2 points
# (77.0% → 75.0%). Not a gate: its units are read through the activation, not as they are.
SITE_OUTPUTS = (MLP, RES)

Stats = tuple[torch.Tensor, torch.Tensor]  # per output channel: mean, standard deviation


def channel_stats(model: nn.Module, cfg: ModelConfig, batch: torch.Tensor, sites: Sequence[tuple[str, int]],
                  batch_size: int) -> dict[tuple[str, int], Stats]:
    """Mean and std (over every token of ``batch``) of each site's output channels in ``model`` (of ``cfg``).

    Each chunk's forward pass stops once every site has recorded it: the layers after the last site are not run.
    """
    sums: dict[tuple[str, int], list[torch.Tensor]] = {}
    wanted = list(dict.fromkeys(sites))
    seen: set[tuple[str, int]] = set()  # the sites the current chunk has reached

    def record(key: tuple[str, int]) -> Hook:
        def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
            terms = _sums(out)
            sums[key] = terms if key not in sums else [s + t for s, t in zip(sums[key], terms, strict=True)]
            seen.add(key)
            if len(seen) == len(wanted):
                raise AllSitesRecorded
        return hook

    hooked_passes(cfg, model, {key: record(key) for key in wanted}, torch.split(batch, batch_size), seen.clear)
    return {key: _moments(*terms) for key, terms in sums.items()}


def _sums(output: torch.Tensor, rows_per_part: int = 16384) -> list[torch.Tensor]:
    """Count, sum and sum of squares over every token of a layer's output, per channel, in float64: summed part by
    part, so no float64 copy of a whole large output is made."""
    parts = output.detach().reshape(-1, output.shape[-1]).split(rows_per_part)
    count = torch.tensor(float(output.numel() // output.shape[-1]), dtype=torch.float64)
    return [count, sum(p.double().sum(0) for p in parts), sum(p.double().square().sum(0) for p in parts)]  # type: ignore[list-item]


def _moments(n: torch.Tensor, total: torch.Tensor, squares: torch.Tensor) -> Stats:
    """Mean and (population) standard deviation from the count, sum and sum of squares."""
    mean = total / n
    return mean, (squares / n - mean * mean).clamp_min(0).sqrt()


def _target(inputs: Sequence[Stats], weights: torch.Tensor) -> Stats:
    """Per channel, the weighted mean of the inputs' mean and std over the inputs whose channel is alive (std > 0;
    a narrower model embedded in the universe has dead channels)."""
    means, stds = torch.stack([m for m, _ in inputs]), torch.stack([s for _, s in inputs])
    held = (stds > 0).double() * weights.to(stds.device)[:, None]
    total = held.sum(0).clamp_min(torch.finfo(torch.float64).tiny)
    return (held * means).sum(0) / total, (held * stds).sum(0) / total


def _reset(state: State, site: str, layer: int, have: Stats, want: Stats) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[w | b]`` of the site's linear layer rescaled and shifted so its channels get ``want``'s statistics;
    a channel the merged model holds constant (std 0) is only shifted. Returns the channels' (scale, shift)."""
    (mean, std), (mean_t, std_t) = have, want
    scale = torch.where(std > 0, std_t / std.clamp_min(torch.finfo(std.dtype).tiny), 1.0)
    name = site.format(l=layer)
    w, b = state[f"{name}.w"], state[f"{name}.b"]
    state[f"{name}.w"] = w * scale.to(w.dtype)[:, None]
    state[f"{name}.b"] = ((b.double() - mean) * scale + mean_t).to(b.dtype)
    return scale, mean_t - mean * scale


@dataclass
class RepairTarget:
    """The inputs' channel statistics on one batch, measured once: REPAIR then resets any weighted merge of those
    inputs (a universe merge, or every point of an interpolation path) to its weights' mean statistics."""

    cfg: ModelConfig
    batch: torch.Tensor
    measured: list[dict[tuple[str, int], Stats]]
    batch_size: int = 128  # samples per forward pass when measuring the inputs

    @classmethod
    def measure(cls, inputs: Sequence[Mapping[str, torch.Tensor]], cfg: ModelConfig, data: Dataset | None,
                samples: int | None = None, batch_size: int = 128) -> RepairTarget:
        """Statistics of ``inputs`` (canonical states of ``cfg``, in one basis and width, e.g. universe matching's
        aligned models) on the first ``samples`` inputs of ``data`` (all if None; training samples, never the
        held-out split)."""
        if data is None or len(data) == 0 or samples == 0:  # type: ignore[arg-type]
            raise ConfigError("REPAIR needs training inputs to measure activation statistics")
        batch = inputs_of(data, len(data) if samples is None else samples)  # type: ignore[arg-type]
        get_arch(cfg.family).check_inputs(cfg, batch)
        order = sites(cfg)
        if unbiased := [s for s, layer in order if inputs and f"{s.format(l=layer)}.b" not in inputs[0]]:
            raise ConfigError(f"REPAIR shifts each channel by its layer's bias; this {cfg.family} model's "
                              f"{unbiased[0]} has none (restore-norms or refit instead)")
        measured = [channel_stats(to_model(s, cfg), cfg, batch, order, batch_size) for s in inputs]
        return cls(cfg, batch, measured, batch_size)

    def repair(self, merged: Mapping[str, torch.Tensor], weights: Sequence[float] | None = None) -> State:
        """``merged`` with every site's output channels reset, in forward order, to the ``weights``-mean (default
        equal) statistics of the inputs, in one forward pass of the whole batch: each site's hook measures its
        output, resets the layer's rows and passes the reset output on, so every later site sees the earlier ones
        repaired (what re-measuring after each site gives, without a pass per site)."""
        n = torch.tensor([1.0] * len(self.measured) if weights is None else list(weights), dtype=torch.float64)
        out, model, order = dict(merged), to_model(merged, self.cfg), sites(self.cfg)

        def correct(site: str, layer: int) -> Hook:
            def hook(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
                have = _moments(*_sums(output))
                scale, shift = _reset(out, site, layer, have, _target([m[site, layer] for m in self.measured], n))
                if (site, layer) == order[-1]:
                    raise AllSitesRecorded  # the layers after the last site change nothing
                return output * scale.to(output.dtype) + shift.to(output.dtype)
            return hook

        hooked_passes(self.cfg, model, {key: correct(*key) for key in order}, [self.batch])
        return out


def sites(cfg: ModelConfig) -> list[tuple[str, int]]:
    """Every repaired site, block by block in forward order; ConfigError where a site has no bias to shift its
    channels' mean by (the Llama families)."""
    arch = get_arch(cfg.family)
    prefixes = block_linears(arch.spec, SITE_OUTPUTS)
    if unbiased := [s for s in prefixes if f"{s}.b" not in arch.spec]:
        raise ConfigError(f"REPAIR shifts each channel by its layer's bias; a {cfg.family} model's "
                          f"{unbiased[0]} has none (restore-norms or refit instead)")
    return [(site, layer) for layer in range(cfg.depth) for site in prefixes]


def repair(merged: Mapping[str, torch.Tensor], inputs: Sequence[Mapping[str, torch.Tensor]], cfg: ModelConfig,
           data: Dataset | None, samples: int | None = None, weights: Sequence[float] | None = None, *,
           batch_size: int = 128) -> State:
    """``merged`` (a canonical standard state of ``cfg``) REPAIRed to the ``weights``-mean statistics of ``inputs``
    on the first ``samples`` inputs of ``data``: :class:`RepairTarget` measured and applied once."""
    return RepairTarget.measure(inputs, cfg, data, samples, batch_size).repair(merged, weights)
