"""The vLLM-compatible replica simulator."""
