"""Keep the GPU busy and see where it waits: Lightning callbacks over plain mechanisms.

- ``gpu_busy.callbacks``: the Lightning callbacks (prefetch, sync detection, idle time,
  throughput and MFU, faults, exact resume, the run summary);
- ``prefetch``, ``syncs``, ``idle``, ``throughput``, ``faults``, ``resume``: the mechanisms
  under them, usable without Lightning.

Example::

    from gpu_busy.callbacks import IdleTimeMonitor, StreamPrefetcher, SyncPointDetector
    trainer = pl.Trainer(callbacks=[StreamPrefetcher(), SyncPointDetector(), IdleTimeMonitor()])
"""
