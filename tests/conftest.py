"""Shared fixtures: tiny random models of the three architectures, built locally, never downloaded."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from dofla.models.tiny import TINY_ARCHITECTURES, build_byte_tokenizer, build_tiny_model  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(params=TINY_ARCHITECTURES)
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(arch):
    return build_tiny_model(arch, seed=0)


@pytest.fixture(scope="session")
def byte_tokenizer():
    return build_byte_tokenizer()
