"""The KV tier: full blocks' K/V kept below the block pool, to be loaded back instead of
recomputed (LMCache, SGLang's HiCache and llama-server's --cache-ram are the anchors).

It knows blocks and bytes, not requests: an entry is one block's K/V for every layer,
named by the block's chain hash (app.engine.kv_manager.hash_block) inside a namespace of
the model's fingerprint. The engine decides what to store and what to load
(app.engine.kv_offload); this package stores, checks and counts.

    fingerprint.py   what must match for an entry to be valid: weights, dtype, layout
    entry.py         the entry format: header, checksum, payload
    tier.py          the Tier protocol every backend follows
    memory.py        host memory: a byte budget, LRU
    redis.py         a Redis server (redis-py): key TTL, timeouts, reconnects by itself
    disk.py          a folder: survives a restart
    backends.py      TierConfig -> a backend
    store_worker.py  writes on a background thread; drops (and counts) when behind
    cost.py          is a load cheaper than recomputing? measured both ways
    stats.py         counters and latency histograms, as frozen snapshots
"""
