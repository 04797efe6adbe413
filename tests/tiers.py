"""Which tier each test file runs in: every file is in one (tests/contracts/ checks).

``make test`` runs the user's tier: what a change to ``template/`` or ``configs/`` can break,
in a few minutes; on a machine with CUDA also every ``gpu`` test of the suite. ``make
test-all`` runs both tiers: the measuring library's own tests too, for a change to
``gpu_busy/``. ``scripts/run_tests.py`` reads this table.

    from tests.tiers import USER     # {path: what of yours it checks}
"""

from __future__ import annotations

USER = {
    "tests/template/test_model.py": "the model: its layout, its errors, its schedule, and "
    "README's test file for your own model (no syncs in its steps)",
    "tests/template/test_data.py": "the data: synthetic, CIFAR-10 and folders, offline",
    "tests/template/test_train.py": "every config through the entry point: fit, validate, "
    "test, predict, resume from last.ckpt, the default fit under the strict sync check",
    "tests/template/test_ddp.py": "one 2-rank DDP fit on the CPU (gloo)",
    "tests/template/test_any_script.py": "the launcher on one unchanged script",
    "tests/gpu/test_gpu.py": "the GPU checks (skipped without CUDA)",
}

LIBRARY = (
    "tests/cli/test_bad_inputs.py",
    "tests/cli/test_cluster_env.py",
    "tests/cli/test_jsonargparse_bounds.py",
    "tests/cli/test_log.py",
    "tests/contracts/test_hook_signatures.py",
    "tests/contracts/test_lightning_compat.py",
    "tests/contracts/test_lock.py",
    "tests/contracts/test_options_and_doors.py",
    "tests/contracts/test_packages_and_contracts.py",
    "tests/faults/test_checkpoints.py",
    "tests/faults/test_faults.py",
    "tests/faults/test_forked_workers.py",
    "tests/faults/test_measurements.py",
    "tests/faults/test_nonfinite_loss.py",
    "tests/faults/test_rank_exit.py",
    "tests/idle/test_idle.py",
    "tests/launcher/test_both_doors.py",
    "tests/launcher/test_hydra_template.py",
    "tests/launcher/test_launcher.py",
    "tests/prefetch/test_prefetch.py",
    "tests/prefetch/test_stream_prefetcher.py",
    "tests/report/test_compare.py",
    "tests/report/test_verdict.py",
    "tests/resume/test_background_checkpoints.py",
    "tests/resume/test_resumable_data.py",
    "tests/resume/test_resume.py",
    "tests/syncs/test_cuda_route.py",
    "tests/syncs/test_device_branches.py",
    "tests/syncs/test_how_a_tensor_was_made.py",
    "tests/syncs/test_libraries_by_installation.py",
    "tests/syncs/test_sync_cases.py",
    "tests/syncs/test_sync_costs.py",
    "tests/syncs/test_sync_fixes.py",
    "tests/syncs/test_sync_point_detector.py",
    "tests/syncs/test_syncs.py",
    "tests/syncs/test_torchmetrics.py",
    "tests/syncs/test_watched_steps.py",
    "tests/throughput/test_cuda_calls.py",
    "tests/throughput/test_throughput.py",
    "tests/whole/test_bench.py",
    "tests/whole/test_fixes_walked.py",
    "tests/whole/test_foreign_clients.py",
    "tests/whole/test_foreign_code.py",
    "tests/whole/test_logged_values.py",
    "tests/whole/test_sharded.py",
    "tests/whole/test_strict_on_tutorial_code.py",
)
