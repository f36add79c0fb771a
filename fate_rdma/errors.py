"""Errors of fate-rdma: one root, classes per failure (STYLE.md §2)."""
from __future__ import annotations


class FateRdmaError(Exception):
    """Root of every fate-rdma error."""


class ConfigError(FateRdmaError, ValueError):
    """Inconsistent or invalid configuration."""
