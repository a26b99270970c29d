"""The workload benchmark (`python -m benchmarks.workloads`): seeded scenarios of what users run (scenarios.py), the
drivers that serve them (offline: offline.py and runs.py, through `LLMEngine`; online: service.py and online.py,
through the service's OpenAI API), and what users see of it (metrics.py)."""
