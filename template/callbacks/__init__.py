"""Lightning callbacks: thin adapters over the mechanisms in ``template.perf``."""

from template.callbacks.run_summary import RunSummary
from template.callbacks.stream_prefetcher import StreamPrefetcher

__all__ = ["RunSummary", "StreamPrefetcher"]
