"""This process's random generator states as one int64 tensor, and back.

torch's CPU generator, the current CUDA device's, NumPy's global one and Python's
``random``, in a fixed layout: cheap to all-gather, and loadable with
``torch.load(weights_only=True)``. Why: docs/ARCHITECTURE.md, "Exact resume".

Example::

    saved = capture_rng_state()
    x = torch.rand(3)
    restore_rng_state(saved)
    assert torch.equal(torch.rand(3), x)
"""

from __future__ import annotations

import random

import numpy as np
import torch

_PY_VERSION = 3  # random.getstate()'s format tag since Python 2.x


def _float_bits(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.float64).view(torch.int64))


def _from_bits(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int64).view(torch.float64))


def capture_rng_state() -> torch.Tensor:
    """Every generator's state, as ``[n_cpu, n_cuda, cpu..., cuda..., numpy..., python...]``."""
    cpu = torch.get_rng_state().to(torch.int64)
    # Only a device already in use: reading its generator would otherwise start CUDA.
    use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    cuda = (
        torch.cuda.get_rng_state().to(torch.int64)
        if use_cuda
        else torch.empty(0, dtype=torch.int64)
    )
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_part = torch.tensor(
        [*keys.tolist(), pos, has_gauss, _float_bits(gauss)], dtype=torch.int64
    )
    _, internal, gauss_next = random.getstate()
    python_part = torch.tensor(
        [*internal, gauss_next is not None, _float_bits(gauss_next or 0.0)], dtype=torch.int64
    )
    header = torch.tensor([len(cpu), len(cuda)], dtype=torch.int64)
    return torch.cat([header, cpu, cuda, numpy_part, python_part])


def restore_rng_state(state: torch.Tensor) -> None:
    """Set every generator from what :func:`capture_rng_state` returned (on any process)."""
    state = state.to("cpu", torch.int64)
    n_cpu, n_cuda = (int(v) for v in state[:2])
    cpu, rest = state[2 : 2 + n_cpu], state[2 + n_cpu :]
    cuda, rest = rest[:n_cuda], rest[n_cuda:]
    numpy_part, python_part = rest[:627], rest[627:]
    if len(python_part) != 627:
        raise ValueError(f"not a state from capture_rng_state (length {len(state)})")
    torch.set_rng_state(cpu.to(torch.uint8))
    if n_cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda.to(torch.uint8))
    keys = numpy_part[:624].numpy().astype(np.uint32)
    pos, has_gauss, gauss = (int(v) for v in numpy_part[624:])
    np.random.set_state(("MT19937", keys, pos, has_gauss, _from_bits(gauss)))
    internal = tuple(int(v) for v in python_part[:625])
    has_next, gauss_next = int(python_part[625]), _from_bits(int(python_part[626]))
    random.setstate((_PY_VERSION, internal, gauss_next if has_next else None))
