"""Admission control for vLLM behind Envoy's ext_proc filter."""

__version__ = "0.1.0"
