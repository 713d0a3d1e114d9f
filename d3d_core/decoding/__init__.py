"""Decoding: settings, the engine (one loop, one strategy per mode), sampling, timing and the Trace."""
