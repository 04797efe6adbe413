"""Mechanisms that keep a run's work through faults; no Lightning imports.

- ``stop_request``: SIGTERM/SIGINT turned into a flag the training loop polls;
- ``peer_watch``: every rank notices within bounded time when another one failed;
- ``training_stopped``: the exception that ends a fit on purpose, with its exit code;
- ``worker_signals``: DataLoader workers that leave SIGTERM/SIGINT to the main process;
- ``log_writes``: logs that cannot be written cost their metrics, not the run.
"""
