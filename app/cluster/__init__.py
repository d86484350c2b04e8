"""Engine replicas on Ray behind one front door (`--replicas N`).

Only imported when more than one replica is asked for: with `--replicas 1` Ray is never
imported. The server talks to a RayCluster exactly as to an AsyncEngine (EngineClient).
"""
