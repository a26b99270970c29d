"""Custom autoscaling policy for the engine deployment: scale on predicted memory demand, not on request counts.

Each engine replica reports `memory_demand` through `record_autoscaling_stats`: the bytes (GPU or host, whichever is
scarcer) and slots its admitted requests are predicted to hold, as a share of its capacity. The policy asks for
enough replicas to bring the mean demand down to `TARGET_MEMORY_DEMAND`; Serve applies the delays and bounds.
"""
from __future__ import annotations

import math

from ray.serve.config import AutoscalingContext

TARGET_MEMORY_DEMAND = 0.75


def desired_replicas(demands: list[float], current: int, lowest: int, highest: int) -> int:
    """Replicas needed for the summed demand at the target share each, within [lowest, highest]."""
    if not demands:
        return max(lowest, min(highest, current))
    needed = math.ceil(sum(demands) / TARGET_MEMORY_DEMAND - 1e-9)
    return max(lowest, min(highest, needed))


def memory_demand_policy(ctx: AutoscalingContext) -> tuple[int, dict]:
    per_replica = (ctx.aggregated_metrics or {}).get("memory_demand", {})
    target = desired_replicas(list(per_replica.values()), ctx.current_num_replicas,
                              ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas)
    return target, ctx.policy_state
