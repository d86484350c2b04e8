"""Is loading blocks from the tier cheaper than recomputing them? Both sides measured.

The load side learns the tier's bandwidth from every load (host memory ~GB/s, Redis on
loopback ~1 GB/s); the compute side learns the engine's seconds per prefill token from its
steps. Until they have measured anything, priors per backend stand in. Recompute time is
taken as linear in tokens, which underestimates it deep in a long history (attention grows
with context), so a doubtful case leans towards recomputing.
"""

from __future__ import annotations

from dataclasses import dataclass

EWMA = 0.2  # weight of the newest measurement
PRIORS = {  # backend kind -> (bytes/s, seconds per lookup)
    "memory": (2e9, 0.0),
    "disk": (1e9, 2e-4),
    "redis": (5e8, 1e-3),
}
COMPUTE_PRIOR_S = 1e-3  # per prompt token: SmolLM2-135M fp32 on 2 CPU cores


@dataclass
class LoadCostModel:
    """Estimates for one tier and one model."""

    bytes_per_block: int
    tokens_per_block: int
    min_speedup: float  # load only when recompute >= min_speedup x load (0: always)
    bandwidth: float  # bytes/s
    latency_s: float
    compute_s_per_token: float = COMPUTE_PRIOR_S

    @classmethod
    def for_backend(
        cls, kind: str, bytes_per_block: int, tokens_per_block: int, min_speedup: float
    ) -> LoadCostModel:
        bandwidth, latency = PRIORS.get(kind, PRIORS["redis"])
        return cls(bytes_per_block, tokens_per_block, min_speedup, bandwidth, latency)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 20:  # small loads measure the latency, not the bandwidth
            rate = nbytes / max(seconds - self.latency_s, 1e-6)
            self.bandwidth += EWMA * (rate - self.bandwidth)

    def observe_compute(self, tokens: int, seconds: float) -> None:
        if tokens >= 32:  # a step of mostly prompt tokens; decodes alone measure little
            self.compute_s_per_token += EWMA * (seconds / tokens - self.compute_s_per_token)

    def load_s(self, num_blocks: int) -> float:
        return self.latency_s + num_blocks * self.bytes_per_block / self.bandwidth

    def recompute_s(self, num_blocks: int) -> float:
        return num_blocks * self.tokens_per_block * self.compute_s_per_token

    def worth_loading(self, num_blocks: int) -> bool:
        if num_blocks <= 0:
            return False
        return self.recompute_s(num_blocks) >= self.min_speedup * self.load_s(num_blocks)
