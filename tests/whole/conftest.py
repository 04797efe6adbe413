"""Whole-program tests run on the CPU (the simulation) and, where CUDA is, on the GPU too:
the same code, held to what CUDA itself does."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def accelerator(request) -> str:
    return request.param
