"""Decoding: generation, speculative rounds, CUDA graphs, draft control, telemetry."""
