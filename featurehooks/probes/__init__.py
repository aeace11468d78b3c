"""Probes on the one hook engine: activation and gradient statistics, non-finite sentinels, gradient modifiers."""
