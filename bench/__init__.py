"""Benchmarks that measure the template's claims side by side (``python -m bench.<name>``)."""
