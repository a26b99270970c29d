"""Where a decode step's device time goes, like the paper's latency table: torch.profiler over a few engine steps,
kernels grouped by name (the Triton kernels of kernels/) and matrix multiplies by which projection launched them."""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

# kernel-name fragments -> group (kernels/*.py launch names; torch.topk's sort kernels)
KERNEL_GROUPS = {
    "_logits_kernel": "scoring", "_scores_kernel": "scoring",
    "topk": "top-k", "TopK": "top-k", "sort": "top-k", "Sort": "top-k",
    "_assign_slots": "bookkeeping",
    "_rebuild_keys": "key rebuild",
    "_fetch_values": "value fetch",
    "_split_kernel": "attention", "_merge_kernel": "attention",
}


def projection(weight_shape: list[int], spec) -> str:
    """Which of the model's projections a linear with this (out, in) weight is."""
    out = weight_shape[0]
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    if out == spec.vocab_size:
        return "lm_head"
    if out == q + 2 * kv:
        return "QKV"
    if out == 2 * inter or weight_shape[1] == inter:
        return "FFN"
    return "o_proj"


def kernel_group(name: str) -> str | None:
    return next((group for fragment, group in KERNEL_GROUPS.items() if fragment in name), None)


def profile_steps(engine, steps: int, cuda: bool) -> dict[str, float]:
    """Milliseconds per step of device time by group (CPU time of the projections on CPU), `other` for the rest
    (norms, RoPE, the new token's U row, sampling, copies); `device_total` sums every kernel: more than the step's
    wall time where the value fetch and key rebuild overlap on their streams. The steps run eager: a CUDA graph's
    replay launches the same kernels but hides which projection launched each. A decode step still in flight
    (async decode) is read back first: its kernels would otherwise run inside the profile and count as the steps'."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    graphs, engine.runner.graphs = engine.runner.graphs, None
    engine.drain_in_flight()
    try:
        with profile(activities=activities, record_shapes=True) as prof:
            for _ in range(steps):
                engine.step()
            if cuda:
                torch.cuda.synchronize()
    finally:
        engine.runner.graphs = graphs
    groups: dict[str, float] = {}
    total = 0.0
    for event in prof.events():
        if cuda and event.device_type == torch.autograd.DeviceType.CUDA:  # a kernel
            total += event.device_time_total
            group = kernel_group(event.name)
            if group is not None:
                groups[group] = groups.get(group, 0.0) + event.device_time_total
        elif event.name == "aten::linear" and len(event.input_shapes) > 1:
            group = projection(event.input_shapes[1], engine.spec)
            spent = event.device_time_total if cuda else event.cpu_time_total
            groups[group] = groups.get(group, 0.0) + spent
    per_step = {group: us / steps / 1e3 for group, us in sorted(groups.items())}
    if cuda:
        per_step["device_total"] = total / steps / 1e3
        per_step["other"] = per_step["device_total"] - sum(v for k, v in per_step.items() if k != "device_total")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20))
    return per_step
