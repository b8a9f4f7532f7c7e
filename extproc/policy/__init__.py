"""The sans-IO admission core: no gRPC, no sockets, no asyncio I/O; time is passed in."""
