"""Ray Serve application: OpenAI-compatible ingress (FastAPI, pydantic schemas), admission control, the memory-aware
request router, the engine replica wrapper, the autoscaling policy and metrics.

May import ray, fastapi, pydantic and `shadowkv_core`. Kept thin: the engine does the work.
"""
