"""Modules the tests share: models, data, probes and stand-ins (not tests themselves)."""
