"""A stand-in for the ``gym`` package with the one environment Lightning's PPO example asks
for (``CartPole-v0``), in gym's pre-0.26 interface that the example is written against:
``reset()`` gives the observation, ``step(action)`` gives ``(observation, reward, done,
info)``. gym itself no longer imports beside numpy 2; this is the cart-pole's textbook
physics (Barto, Sutton and Anderson, 1983), seeded, so two runs see the same episodes.
"""

from __future__ import annotations

import math
import types

import numpy as np


class Box:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


class Discrete:
    def __init__(self, n: int) -> None:
        self.n = n


spaces = types.SimpleNamespace(box=types.SimpleNamespace(Box=Box),
                               discrete=types.SimpleNamespace(Discrete=Discrete))  # fmt: skip


class CartPole:
    observation_space = Box((4,))
    action_space = Discrete(2)

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)
        self._state = np.zeros(4)

    def reset(self) -> np.ndarray:
        self._state = self._rng.uniform(-0.05, 0.05, size=4)
        return self._state.astype(np.float32)

    def step(self, action) -> tuple[np.ndarray, float, bool, dict]:
        x, x_dot, theta, theta_dot = self._state
        force = 10.0 if int(action) == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
        theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / 1.1))
        x_acc = temp - 0.05 * theta_acc * cos / 1.1
        tau = 0.02
        self._state = np.array([x + tau * x_dot, x_dot + tau * x_acc,
                                theta + tau * theta_dot, theta_dot + tau * theta_acc])  # fmt: skip
        done = abs(self._state[0]) > 2.4 or abs(self._state[2]) > 12 * 2 * math.pi / 360
        return self._state.astype(np.float32), 1.0, bool(done), {}


def make(name: str) -> CartPole:
    if name != "CartPole-v0":
        raise ValueError(f"{name}: this stand-in has CartPole-v0 only")
    return CartPole()
