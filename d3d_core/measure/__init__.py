"""Measuring: benchmark prompt sets, the bench, per-forward costs, the latency model and its clock, machine facts."""
