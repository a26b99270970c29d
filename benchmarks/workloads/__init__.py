"""The workload benchmark (`python -m benchmarks.workloads`): seeded scenarios of what users run (scenarios.py), the
drivers that serve them (offline.py), and what users see of it (metrics.py)."""
