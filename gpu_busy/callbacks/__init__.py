"""Lightning callbacks, one per file: thin adapters over the mechanisms in ``gpu_busy``
(``prefetch``, ``syncs``, ``idle``, ``throughput``, ``faults``, ``resume``); ``ranks`` gathers their
figures over ranks and writes them once."""

from gpu_busy.callbacks.best_checkpoint import BestCheckpoint
from gpu_busy.callbacks.checkpoint_rng_state import CheckpointRngState
from gpu_busy.callbacks.checkpoint_writers import OneWriterPerCheckpoint
from gpu_busy.callbacks.every_rank import EveryRankAttached
from gpu_busy.callbacks.idle_time_monitor import IdleTimeMonitor
from gpu_busy.callbacks.nonfinite_loss import StopOnNonFiniteLoss
from gpu_busy.callbacks.progress_bar import LoggingStepProgressBar
from gpu_busy.callbacks.rank_failure import StopOnRankFailure
from gpu_busy.callbacks.run_summary import RunSummary
from gpu_busy.callbacks.stop_on_signal import StopOnSignal
from gpu_busy.callbacks.stream_prefetcher import StreamPrefetcher
from gpu_busy.callbacks.sync_point_detector import SyncPointDetector
from gpu_busy.callbacks.throughput_monitor import ThroughputMonitor

__all__ = [
    "BestCheckpoint",
    "CheckpointRngState",
    "EveryRankAttached",
    "IdleTimeMonitor",
    "LoggingStepProgressBar",
    "OneWriterPerCheckpoint",
    "RunSummary",
    "StopOnNonFiniteLoss",
    "StopOnRankFailure",
    "StopOnSignal",
    "StreamPrefetcher",
    "SyncPointDetector",
    "ThroughputMonitor",
]
