"""The tools around the runtime: simulator, load generator, local stack, demo, calibrate, check, docs generator.

The runtime (policy, server, store, telemetry) does not import from here; tests/test_layout.py keeps it so.
"""
