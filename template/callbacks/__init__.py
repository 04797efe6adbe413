"""Lightning callbacks: thin adapters over the mechanisms in ``template.perf``."""

from template.callbacks.idle_time_monitor import IdleTimeMonitor
from template.callbacks.nonfinite_loss import StopOnNonFiniteLoss
from template.callbacks.progress_bar import LoggingStepProgressBar
from template.callbacks.run_summary import RunSummary
from template.callbacks.sigterm_check import SigtermCheckInterval
from template.callbacks.stream_prefetcher import StreamPrefetcher
from template.callbacks.sync_point_detector import SyncPointDetector

__all__ = [
    "IdleTimeMonitor",
    "LoggingStepProgressBar",
    "RunSummary",
    "SigtermCheckInterval",
    "StopOnNonFiniteLoss",
    "StreamPrefetcher",
    "SyncPointDetector",
]
