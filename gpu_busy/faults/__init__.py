"""Mechanisms that keep a run's work through faults; no Lightning imports.

- ``rng_state``: random generator states as one tensor per rank, for exact resumes;
- ``stop_request``: SIGTERM/SIGINT turned into a flag the training loop polls;
- ``peer_watch``: every rank notices within bounded time when another one failed.
"""
