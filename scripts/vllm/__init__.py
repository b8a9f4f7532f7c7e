"""A real vLLM (CPU) for the e2e suite and the parity fixtures: venv setup, tiny model, server, fixture recorder."""
