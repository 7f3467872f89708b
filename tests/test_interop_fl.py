"""Federated runs from pretrained models: ``init`` names a timm / HF / glmc checkpoint, or a folder of them."""

from __future__ import annotations

import pytest
import timm
import torch

from federation import protocol
from federation.settings import RunSettings
from glmc.errors import ConfigError
from tests.interop_models import TIMM, TIMM_FOLDER, Library, perturb
from tests.test_flower_sim import needs_data, run_in_process, server_identity  # noqa: F401 (a fixture)

# A timm ViT of Fashion-MNIST's shapes (and of vit-tiny's widths, so HeteroFL-style tiers divide it).
KWARGS = dict(model_name="vit_tiny_patch16_224", img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=32,
              depth=2, num_heads=2, mlp_ratio=2.0, class_token=False, global_pool="avg", init_values=0.5)


def _pretrained(path, seed, lib: Library = TIMM):
    torch.manual_seed(seed)
    model = perturb(timm.create_model(**KWARGS), seed)
    lib.save(model, path, KWARGS)
    return model


@pytest.mark.slow
@needs_data
@pytest.mark.parametrize(("lib", "name"), [(TIMM, "vit.safetensors"), (TIMM_FOLDER, "timm-hub-folder")])
def test_every_client_starts_from_the_init_checkpoint(tmp_path, server_identity, lib, name):  # noqa: F811
    model = _pretrained(tmp_path / name, 0, lib)
    grid = run_in_process(tmp_path, **{"num-server-rounds": 1, "aggregation": "weight", "init": str(tmp_path / name)})
    sent = grid.sent[0][0].content[protocol.ARRAYS].to_torch_state_dict()
    assert sent.keys() == model.state_dict().keys()
    assert all(torch.equal(sent[k], v) for k, v in model.state_dict().items())  # round 1 ships the checkpoint
    settings = RunSettings(init=str(tmp_path / name))
    assert not settings.independent_start and settings.init_checkpoints == [tmp_path / name]


@pytest.mark.slow
@needs_data
def test_a_folder_of_checkpoints_starts_clients_apart(tmp_path, server_identity, caplog):  # noqa: F811
    (tmp_path / "starts").mkdir()
    for i in range(2):
        _pretrained(tmp_path / "starts" / f"client-{i}.safetensors", i)
    settings = RunSettings(init=str(tmp_path / "starts"))
    assert settings.independent_start and [p.name for p in settings.init_checkpoints] == [
        "client-0.safetensors", "client-1.safetensors"]
    caplog.set_level("INFO", logger="client")
    run_in_process(tmp_path, **{"num-server-rounds": 1, "aggregation": "weight", "init": str(tmp_path / "starts")})
    starts = sorted(r.getMessage() for r in caplog.records if "starts from" in r.getMessage())
    assert [s.split("/")[-1] for s in starts] == ["client-0.safetensors", "client-1.safetensors",
                                                  "client-0.safetensors"]  # partition p: checkpoint p mod 2
    assert (tmp_path / "inproc" / "checkpoints" / "round-001.safetensors").is_file()


@needs_data
def test_a_checkpoint_that_does_not_fit_the_data_is_refused(tmp_path):
    from federation.data import pool

    wrong = dict(KWARGS, num_classes=7)
    TIMM.save(perturb(timm.create_model(**wrong), 0), tmp_path / "v7.safetensors", wrong)
    with pytest.raises(ConfigError, match=r"num_classes 7 \(the data needs 10\)"):
        pool(RunSettings(init=str(tmp_path / "v7.safetensors")))
    with pytest.raises(ConfigError, match="init must be one of"):
        RunSettings(init=str(tmp_path / "missing"))
