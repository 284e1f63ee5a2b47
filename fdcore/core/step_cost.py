"""What a worker's forward pass is expected to take, so that a long one is not called a hang (pure).

A worker inside one forward pass neither ticks its heartbeat nor makes progress: the pass is one call
into the kernels. Most passes take milliseconds, but a model large for the CPU given a full prefill
budget takes far longer than ``hang_timeout`` (a 1.5 B float32 model, 1,024 prompt tokens on 2 cores:
~30 s), and a worker killed for it is restarted into the same step, forever. So before each pass the
worker writes on its health slot a grace deadline (health.GRACE): now plus GRACE_FACTOR times what
:class:`StepCost` expects; the supervisor calls no hang before it, and counts ``hang_timeout`` from
its end. A pass that wedges is still found, only later by the size of the pass it wedged in.

The estimate is a fixed part (a one-token pass: reading the weights) and a part per token, each the
largest seen lately: a slow pass (a busy machine) raises it at once, and it sinks back by DECAY a pass.
Until a pass is measured (a tensor-parallel rank, which has no warm-up) it is the bound of a slow CPU
for the model's parameter count: SLOW_FLOPS and SLOW_BYTES.
"""

from __future__ import annotations

GRACE_FACTOR = 4.0  # a pass may take this many times its expected cost before the hang timeout counts
DECAY = 0.99  # per pass: how fast a raised estimate sinks back
SLOW_FLOPS = 2e9  # floating-point operations a second of a slow CPU core (an unmeasured worker's bound)
SLOW_BYTES = 2e9  # bytes a second such a CPU reads the weights at


class StepCost:
    """Expected seconds of a forward pass of ``tokens`` tokens, learnt from the passes measured."""

    def __init__(self, per_pass: float, per_token: float, measured: bool = True):
        self.per_pass = per_pass  # seconds: a one-token pass
        self.per_token = per_token  # seconds each further token adds
        self._pass_known = self._token_known = measured  # (else: a bound, replaced by the first measurement)

    @classmethod
    def unmeasured(cls, parameters: int, bytes_per_parameter: float = 4.0) -> StepCost:
        """A slow CPU's cost for a model of ``parameters`` weights: a generous bound until a pass is timed."""
        return cls(parameters * bytes_per_parameter / SLOW_BYTES, 2.0 * parameters / SLOW_FLOPS, measured=False)

    def expected(self, tokens: int) -> float:
        return self.per_pass + max(tokens - 1, 0) * self.per_token

    def grace(self, tokens: int) -> float:
        """Seconds the pass may run before a hang timeout starts counting."""
        return GRACE_FACTOR * self.expected(tokens)

    def record(self, tokens: int, seconds: float) -> None:
        """A pass of ``tokens`` tokens took ``seconds``. A first measurement replaces the unmeasured bound;
        later ones raise the estimate at once or let it sink by DECAY."""
        if tokens <= 1:
            self.per_pass = max(seconds, self.per_pass * DECAY) if self._pass_known else seconds
            self._pass_known = True
            return
        base = self.per_pass if self._pass_known else 0.0  # (no one-token pass timed yet: all of it per token)
        cost = max((seconds - base) / (tokens - 1), 0.0)
        self.per_token = max(cost, self.per_token * DECAY) if self._token_known else cost
        self._token_known = True


def parameter_count(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int
) -> int:
    """Weights a token's pass multiplies by (a decoder's projections and its LM head)."""
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    return layers * (attention + 3 * hidden * intermediate) + vocab * hidden
