"""The run config checked whole before round 1 (federation/preflight.py), in one line naming the key and its choices;
the same check runs inside `flwr run` (tests/test_newcomer.py drives that end to end)."""

from __future__ import annotations

import pytest

from federation.preflight import check_run_config, fitting_partitioners
from federation.settings import LABEL_SPLITS, RunSettings
from glmc.errors import ConfigError
from server.submission import flwr_run_params


def test_a_datasets_default_partitioner_fits_it() -> None:
    assert RunSettings(dataset="shakespeare").partitioner == "role"
    assert RunSettings().partitioner == "dirichlet"
    assert RunSettings(dataset="shakespeare", partitioner="play").partitioner == "play"
    for dataset, model in (("shakespeare", "gpt2-tiny"), ("fashion-mnist", "vit-tiny")):
        settings = check_run_config({"dataset": dataset, "model": model})
        assert settings.partitioner in fitting_partitioners(dataset, "gpt2" if model == "gpt2-tiny" else "vit")


@pytest.mark.parametrize(("config", "expect"), [
    ({"num-server-round": 3}, "unknown run-config key 'num-server-round': did you mean 'num-server-rounds'"),
    ({"colour": "blue"}, "unknown run-config key 'colour': the keys are in docs/run-config.md"),
    ({"dataset": "shakespeare", "model": "gpt2-tiny", "partitioner": "shard"},
     "partitioner 'shard' does not split shakespeare; partitioner must be one of role, play"),
    ({"partitioner": "role"}, "partitioner 'role' does not split fashion-mnist; partitioner must be one of "
                              + ", ".join(LABEL_SPLITS)),
    ({"dataset": "shakespeare-bpe", "model": "gpt2-tiny"}, "dataset 'shakespeare-bpe' cannot be split among clients"),
    ({"dataset": "shakespeare", "model": "bert-tiny"}, "a bert model learns masked tokens"),
    ({"model": "gpt2-tiny", "dataset": "shakespeare", "width-tiers": "1,0.5"}, None),  # GPT-2 widths may differ
    ({"model": "neox-tiny", "dataset": "shakespeare", "width-tiers": "1,0.5,0.25"}, None),  # every family's may
    ({"model": "llama-tiny", "dataset": "shakespeare", "width-tiers": "1,0.5"}, None),
    ({"model": "llama-tiny", "dataset": "shakespeare", "width-tiers": "1,0.25"},
     "width-tiers '1,0.25': llama models of these widths cannot be merged (width multiplier 0.25 does not divide the "
     "2 KV heads"),
])
def test_a_bad_run_config_is_one_line_naming_the_key_and_its_choices(config, expect) -> None:
    if expect is None:
        check_run_config(config)
        return
    with pytest.raises(ConfigError) as err:
        check_run_config(config)
    assert expect in str(err.value) and "\n" not in str(err.value)


def test_the_check_inside_flwr_run_does_nothing_elsewhere() -> None:
    """Importing ``server`` (tests, the apps' own processes) is no `flwr run`: nothing is checked or registered."""
    assert flwr_run_params() is None
