"""``glmc merge`` (``merge_models`` with ``lazy``) over lazy states: each input's canonical form folded, moved by
every universe iteration and averaged tensor by tensor on each read (:class:`glmc.core.state.Lazy`), at the default
iterations, is bit for bit the merge of the whole-state path (every canonical form and aligned model held in float64),
and the lazy path is the one taken: no aligned model is held whole."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from glmc.archs import build_model, get_arch
from glmc.cli import main as glmc_cli
from glmc.core.state import Lazy
from glmc.merging import evaluation, merge
from glmc.merging.evaluation import ensemble_metrics, evaluate_merge
from glmc.merging.merge import Merged, MergeSetup
from glmc.merging.universe import members
from glmc.symmetry.canonical import canonicalize
from glmc.train import evaluate
from tests.symmetry_models import MERGE_CONFIGS, merge_data, random_native
from tests.test_lazy import _cfg, _models, _native, _written


def _spied(monkeypatch: pytest.MonkeyPatch) -> list[Merged]:
    """Every merge :func:`glmc.merging.merge.merge_models` makes from now on, kept to be looked at."""
    seen: list[Merged] = []
    made: Callable[..., Merged] = merge.merge_models

    def kept(*args: Any, **kwargs: Any) -> Merged:
        seen.append(made(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(merge, "merge_models", kept)
    return seen


def _held_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole-state path: every canonical form held whole in float64, so the universe moves whole models."""
    monkeypatch.setattr(merge, "canonical_view", canonicalize)


def _lazily(done: Merged) -> bool:
    """The merge held no aligned model whole, ran universe iterations after the first, and U is held once."""
    universe = done.universe
    return all(isinstance(s, Lazy) for s in universe.aligned) and len(universe.history) > 1 and \
        isinstance(universe.merged, dict)


def _course(done: Merged) -> list[tuple[int, float, float]]:
    """Each universe iteration's distances (the objective and how far U moved), which decide when it stops."""
    return [(r.iteration, r.mean_distance, r.change) for r in done.universe.history]


@pytest.mark.parametrize(("name", "dtype", "n", "flags"), [
    ("gpt2-tiny", torch.float32, 2, ["--format", "glmc"]),
    ("llama-tiny", torch.bfloat16, 3, ["--dtype", "bfloat16", "--weights", "1,2,5"]),
    ("neox-tiny", torch.bfloat16, 2, ["--method", "weight-perm", "--format", "glmc", "--restore-norms"]),
])
def test_glmc_merge_lazily_writes_what_the_whole_state_merge_writes(name: str, dtype: torch.dtype, n: int,
                                                                   flags: list[str], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _models(tmp_path, name, dtype, n)
    suffix = ".safetensors" if "glmc" in flags else ""
    got, want = (tmp_path / way / f"merged{suffix}" for way in ("lazy", "whole"))  # one name: glmc's metadata
    for folder in (got.parent, want.parent):
        folder.mkdir()
    seen = _spied(monkeypatch)
    for out in (got, want):
        assert glmc_cli(["merge", *map(str, paths), "--out", str(out), "--device", "cpu", *flags]) == 0
        _held_whole(monkeypatch)  # the second merge: the whole-state path
    assert _lazily(seen[0]) and not any(isinstance(s, Lazy) for s in seen[1].universe.aligned)
    assert _course(seen[0]) == _course(seen[1])
    assert _written(got) == _written(want)
    assert _written(got) != _written(paths[0])  # a merge, not a copy of the first input


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "neox-tiny", "vit-tiny"])
def test_a_merge_of_lazy_states_is_the_whole_state_merge(name: str) -> None:
    """merge_models with ``lazy`` (as ``glmc merge`` calls it) and without (as glmc.merge and the FL server, whose
    inputs are in memory, call it) give the same merge bit for bit, each by its own path."""
    cfg = _cfg(name)
    natives = []
    for seed in range(3):
        model: Any = build_model(cfg)
        model.load_state_dict(_native(cfg, seed))
        natives.append(model.state_dict())
    lazy, whole = (merge.merge_models(members(natives, [cfg] * 3, [1.0, 3.0, 2.0]), MergeSetup(cfg), lazy=way)
                   for way in (True, False))
    assert _lazily(lazy) and isinstance(whole.universe.aligned[0], dict)
    got, want = lazy.universe.merged, whole.universe.merged
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in got)
    first = canonicalize(get_arch(cfg.family), natives[0], cfg, dtype=torch.float64)
    assert not torch.equal(got[next(iter(got))], first[next(iter(got))])  # a merge, not the first input


@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_an_evaluated_merge_scores_the_inputs_and_their_ensemble_one_float32_model_at_a_time(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = MERGE_CONFIGS[name]
    configs = [cfg, cfg, cfg.replace(mlp=cfg.mlp // 2)]  # two widths: one shell each
    natives = [{k: v.to(torch.bfloat16) for k, v in random_native(c, seed).items()}
               for seed, c in enumerate(configs)]
    test, setup, arch = merge_data(cfg), merge.MergeSetup(cfg), get_arch(cfg.family)
    made: list[evaluation.LoadedEnsemble] = []

    class Kept(evaluation.LoadedEnsemble):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(evaluation, "LoadedEnsemble", Kept)
    monkeypatch.setattr(evaluation, "LogitEnsemble", None)  # no ensemble of N modules held at once
    report = evaluate_merge(merge.merge_models(members(natives, configs), setup).universe, natives, configs, setup,
                            test, 2)
    monkeypatch.undo()
    assert [len(e.shells) for e in made] == [2]
    models = []  # as they were scored before: every input a float32 model, all held at once
    for native, c in zip(natives, configs, strict=True):
        model = build_model(c).eval()
        model.load_state_dict(native)
        models.append(model)
    assert report["inputs"] == [evaluate(m, arch, test) for m in models]
    assert report["ensemble"] == ensemble_metrics(models, arch, test)
    assert report["ensemble"] != report["inputs"][0]
