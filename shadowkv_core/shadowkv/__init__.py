"""ShadowKV: the KV cache kept "in shadows". `reference` holds one pure function per step, the oracle of the Triton
kernels; `manager` the shadow's bookkeeping; `cache.ShadowKVCache` drives the steps (prefill.py, decode.py and the
kernel path in fast_decode.py) behind the KVCache interface; `hybrid.HybridCache` keeps short sequences dense beside
it, the cache a ShadowKV engine runs."""
