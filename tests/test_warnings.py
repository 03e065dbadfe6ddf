"""Every warning asyncckpt issues is an ``AsyncCkptWarning``, so users can filter them."""

from __future__ import annotations

import warnings

import pytest
import torch

from asyncckpt import _settings
from asyncckpt._device import Placement
from asyncckpt._settings import Settings
from asyncckpt.errors import AsyncCkptWarning


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_the_cpu_fallback_of_a_cuda_tensor_is_an_asyncckpt_warning() -> None:
    with pytest.warns(AsyncCkptWarning, match="loaded on the CPU"):
        assert Placement(None).device_for("cuda:0") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_one_filter_silences_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_settings, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any other warning fails this test
        warnings.filterwarnings("ignore", category=AsyncCkptWarning)
        Placement(None).device_for("cuda:0")
        Settings.resolve({"ASYNCCKPT_THREAD": "2"})
