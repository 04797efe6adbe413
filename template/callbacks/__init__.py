"""Lightning callbacks: thin adapters over the mechanisms in ``template.perf``."""

from template.callbacks.run_summary import RunSummary

__all__ = ["RunSummary"]
