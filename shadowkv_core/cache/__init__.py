"""KV caches as the engine sees them: a manager (CPU bookkeeping of what each sequence holds) and a cache (the device
side a forward's attention layers call). `dense` keeps every token's keys and values in blocks; `hybrid` keeps short
sequences dense and long ones in the shadow (`shadowkv_core.shadowkv`); `build` sizes and builds an engine's cache."""
