"""dofla reads the hub's offline flags as the hub does: ``no``/``off``/``0`` mean online."""
from __future__ import annotations

import socket

import pytest
from huggingface_hub import constants

from dofla.hub import hub_offline, hub_reachable

FLAGS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


@pytest.fixture
def online(monkeypatch):
    for name in FLAGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return monkeypatch


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("value", ["1", "ON", "yes", "true", "0", "no", "off", "False", ""])
def test_each_offline_variable_is_read_with_the_hubs_truth_values(online, name, value):
    online.setenv(name, value)
    # huggingface_hub's own parser of these variables, the one behind its HF_HUB_OFFLINE constant
    assert hub_offline() == constants._is_true(value) == (value.upper() in {"1", "ON", "YES", "TRUE"})


def test_the_hubs_own_flag_counts_when_the_environment_says_nothing(online):
    assert not hub_offline()
    online.setattr(constants, "HF_HUB_OFFLINE", True)  # as huggingface_hub set it at import, or forced_offline
    assert hub_offline()


def test_an_explicit_no_leaves_a_reachable_endpoint_reachable(online):
    with socket.socket() as server:  # a real listener standing in for the hub
        server.bind(("127.0.0.1", 0))
        server.listen()
        online.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        online.setenv("HF_HUB_OFFLINE", "no")
        assert hub_reachable(timeout=5)
        online.setenv("HF_HUB_OFFLINE", "yes")
        assert not hub_reachable(timeout=5)
