"""The ext_proc gRPC adapter and the HTTP side (metrics, health)."""
