"""The one door to Lightning's internals: every private attribute, method or source file of
Lightning the template reads, writes or extends is in this package, each named in a comment
where it is touched and pinned by ``tests/contracts/test_lightning_compat.py``. When a
Lightning release renames one, that test fails with the name, instead of the template
silently misbehaving; ``test_nothing_outside_lightning_compat_reaches_a_private_of_lightning``
fails where code elsewhere in ``gpu_busy/`` reaches one.

Example::

    from gpu_busy import lightning_compat as compat

    if compat.is_logging_step(trainer):
        ...
"""

from gpu_busy.lightning_compat.files import (
    chooses_devices,
    is_lightning_file,
    restores_a_checkpoint,
)
from gpu_busy.lightning_compat.hooks import (
    BATCH_HOOKS,
    Callback,
    around_callback_hooks,
    lighter_dispatch,
    skip_empty_hooks,
    skip_hooks,
)
from gpu_busy.lightning_compat.logged_metrics import (
    LoggedAt,
    is_logging_step,
    logger_step,
    metrics_at_last_step_end,
    prog_bar_numbers_when_read,
)
from gpu_busy.lightning_compat.loops import (
    combined_loader,
    epoch_position,
    fetched_ahead,
    fetcher_counts,
)
from gpu_busy.lightning_compat.overrides import (
    SaveGatedCheckpoint,
    never_overwrites,
    set_data_parallel_size,
)
from gpu_busy.lightning_compat.processes import (
    child_exit_codes,
    children_run_through,
    ddp_used_parameter_map,
    defer_child_observer,
    keep_handlers_past_teardown,
    moves_to_the_cpu_as_to_cuda,
    started_ranks,
    throttle_sigterm_broadcast,
)

__all__ = [
    "BATCH_HOOKS", "Callback", "LoggedAt", "SaveGatedCheckpoint", "around_callback_hooks",
    "child_exit_codes", "children_run_through", "chooses_devices", "combined_loader",
    "ddp_used_parameter_map",
    "defer_child_observer", "epoch_position", "fetched_ahead", "fetcher_counts",
    "is_lightning_file", "is_logging_step", "keep_handlers_past_teardown", "lighter_dispatch",
    "logger_step", "metrics_at_last_step_end", "moves_to_the_cpu_as_to_cuda", "never_overwrites",
    "prog_bar_numbers_when_read", "restores_a_checkpoint", "set_data_parallel_size",
    "skip_empty_hooks", "skip_hooks", "started_ranks", "throttle_sigterm_broadcast",
]  # fmt: skip
