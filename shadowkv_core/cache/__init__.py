"""KV caches as the engine sees them: a manager (CPU bookkeeping of what each sequence holds) and a cache (the device
side a forward's attention layers call), in `base`; `dense` keeps every token's keys and values in blocks. The shadow
(`shadowkv_core.shadowkv`) builds on these, and its `hybrid` cache keeps short sequences in a dense one."""
