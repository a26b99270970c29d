"""ShadowKV: the KV cache kept "in shadows" (DESIGN.md's data path). `reference` holds one pure function per step,
the oracle of the Triton kernels; `cache.ShadowKVCache` drives those steps behind the KVCache interface."""
