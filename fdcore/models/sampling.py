"""Token sampling as a pure function of (logits, request state): no processes, no model.

Order of operations (vLLM's): the tokens a structured output's grammar does
not allow next removed, penalties on the raw logits (repetition over prompt
and output, presence and frequency over the output), the request's logit_bias
added, EOS and stop tokens masked until ``min_tokens`` (unless the grammar
allows nothing else); then greedy argmax, or temperature, top-k, top-p and
min-p filters and one draw. Logprobs are the model's own, before all of it.

NOTE: a draw is Gumbel-max with noise from a counter-based hash of ``(seed,
position, token id)`` (:func:`gumbel_noise`), so the token depends only on the
request's own logits, seed and position: never on what else is in the batch,
nor on how often the request was recomputed, and it is robust to the few-ulp
differences a recompute in another batch shape brings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fdcore.core.token_mask import allowed_tokens, mask_words
from fdcore.protocol import PromptLogprob, SamplingParams


@dataclass
class SamplerRequest:
    """What the sampler needs of one request at one step, built for that step by its caller (the worker
    from its ``SeqState``, EngineCore from its ``Request``): parameters, the tokens so far (penalties, and
    the position the draw's randomness is keyed by) and a grammar's mask. A value, not a record: sampling
    is a pure function of it and the logits, so nothing in it outlives the step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    # what a structured output's grammar allows next: [(vocab + 31) // 32] int32, bit t % 32 of word t // 32
    allowed: np.ndarray | None = None

    def __post_init__(self) -> None:
        # The engine fills unset parameters with the model's defaults; a caller that does not go
        # through it gets the neutral ones (a no-op check otherwise).
        self.params = self.params.with_defaults()

    @property
    def position(self) -> int:
        """Index (in prompt + output) of the token about to be drawn."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class Sampled:
    token_id: int
    logprob: float | None = None  # only computed for requests that ask for logprobs
    top_logprobs: list[tuple[int, float]] | None = None


def sample(logits: np.ndarray, requests: list[SamplerRequest]) -> list[Sampled]:
    """One token for each row of ``logits`` ([batch, vocab], float32)."""
    logits = np.asarray(logits, dtype=np.float32)
    tokens = np.empty(len(requests), dtype=np.int64)
    greedy, plain, other = [], [], []
    for i, request in enumerate(requests):
        kind = _kind(request)
        (greedy if kind == GREEDY else plain if kind == PLAIN else other).append(i)
    if greedy:
        tokens[greedy] = np.argmax(_greedy_rows(logits, requests, greedy), axis=1)
    if plain:
        tokens[plain] = _sample_plain(logits, requests, plain)
    for i in other:
        tokens[i] = _sample_one(_constrained(logits, requests, [i])[0], requests[i])
    wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    results = [Sampled(int(token)) for token in tokens]
    if wanted:  # a log-softmax over the vocabulary costs as much as the rest of sampling
        for i, row in zip(wanted, _log_softmax(logits[wanted]), strict=True):
            results[i] = _result(results[i].token_id, row, requests[i].params.logprobs)
    return results


GREEDY, PLAIN, OTHER = range(3)


def _greedy_rows(logits: np.ndarray, requests: list[SamplerRequest], rows: list[int]) -> np.ndarray:
    """What argmax reads: the logits themselves when every row is greedy and unconstrained (a batch-1
    step: no copy of a vocabulary's floats, ~0.05 ms cold after a forward), else ``_constrained``'s copy."""
    if len(rows) == len(logits) and all(requests[i].allowed is None for i in rows):
        return logits
    return _constrained(logits, requests, rows)


def _constrained(logits: np.ndarray, requests: list[SamplerRequest], rows: list[int]) -> np.ndarray:
    """Those rows' logits (a copy) with the tokens each row's grammar forbids at -inf."""
    drawn = logits[rows]
    for j, i in enumerate(rows):
        if requests[i].allowed is not None:
            drawn[j, ~allowed_tokens(requests[i].allowed, logits.shape[1])] = -np.inf
    return drawn


def _kind(request: SamplerRequest) -> int:
    """GREEDY: argmax; PLAIN: temperature only (drawn for the whole batch at once); OTHER: row by row.

    A request's kind depends only on its own parameters and position, so it
    draws the same token whichever rows share its batch.
    """
    p = request.params
    if (
        p.repetition_penalty != 1
        or p.presence_penalty
        or p.frequency_penalty
        or p.logit_bias
        or len(request.output_token_ids) < p.min_tokens
    ):
        return OTHER
    if p.temperature == 0:
        return GREEDY
    if p.top_k in (0, -1) and p.top_p >= 1 and p.min_p <= 0:
        return PLAIN
    return OTHER


def _sample_plain(logits: np.ndarray, requests: list[SamplerRequest], rows: list[int]) -> np.ndarray:
    """Temperature sampling of many rows at once (Gumbel-max; the C++ kernel when built, which
    reads the grammars' packed masks itself: no copy of the logits, no unpacked mask)."""
    chosen = [requests[i] for i in rows]
    keys = np.asarray([_draw_key(r.params.seed, r.position) for r in chosen], dtype=np.uint64)
    inv_t = np.asarray([1.0 / r.params.temperature for r in chosen], dtype=np.float32)
    kernel = _gumbel_kernel()
    if kernel is not None:
        from fdcore.models.tensors import as_paddle

        allowed = None
        if any(r.allowed is not None for r in chosen):
            allowed = np.full((len(rows), mask_words(logits.shape[1])), -1, dtype=np.int32)
            for j, r in enumerate(chosen):
                if r.allowed is not None:
                    allowed[j] = r.allowed
            allowed = as_paddle(allowed)
        picks = kernel(
            as_paddle(np.ascontiguousarray(logits[rows])), as_paddle(keys.view(np.int64)), as_paddle(inv_t), allowed
        )
        return picks.numpy()
    return np.asarray(
        [
            int(np.argmax(row * t + gumbel_noise(int(k), row.size)))
            for row, k, t in zip(_constrained(logits, requests, rows), keys, inv_t, strict=True)
        ]
    )


_kernels: list = []


def _gumbel_kernel():
    if not _kernels:
        from fdcore.models.kernels import gumbel_sample

        _kernels.append(gumbel_sample())
    return _kernels[0]


def _sample_one(row: np.ndarray, request: SamplerRequest) -> int:
    p = request.params
    apply_penalties(row, request)
    if p.logit_bias:
        row[np.fromiter(p.logit_bias.keys(), dtype=np.int64)] += np.fromiter(p.logit_bias.values(), dtype=np.float32)
    if len(request.output_token_ids) < p.min_tokens:
        banned = [t for t in (*request.eos_token_ids, *p.stop_token_ids) if 0 <= t < row.size]
        kept = row[banned]
        row[banned] = -np.inf
        if not np.isfinite(row).any():  # a grammar that is complete allows only EOS: it wins over min_tokens
            row[banned] = kept
    if p.temperature == 0:
        return int(np.argmax(row))
    candidates, _ = filtered_distribution(row / p.temperature, p)
    noise = gumbel_noise(_draw_key(p.seed, request.position), row.size)[candidates]
    scores = row[candidates] * np.float32(1.0 / p.temperature) + noise
    return int(candidates[np.argmax(scores)])


def apply_penalties(row: np.ndarray, request: SamplerRequest) -> None:
    """Repetition (prompt and output), presence and frequency (output) penalties, in place."""
    p = request.params
    if p.repetition_penalty != 1:
        seen = np.unique(np.asarray(request.prompt_token_ids + request.output_token_ids, dtype=np.int64))
        values = row[seen]
        row[seen] = np.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
        ids, counts = np.unique(np.asarray(request.output_token_ids, dtype=np.int64), return_counts=True)
        row[ids] -= p.frequency_penalty * counts + p.presence_penalty


def filtered_distribution(scaled: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Surviving token ids (in vocabulary order) and their unnormalised probabilities."""
    probs = np.exp(scaled - scaled.max())
    keep = np.isfinite(scaled)
    if 0 < p.top_k < scaled.size:
        kth = np.partition(scaled, scaled.size - p.top_k)[scaled.size - p.top_k]
        keep &= scaled >= kth
    if p.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order] * keep[order]
        cumulative = np.cumsum(sorted_probs) / sorted_probs.sum()
        cutoff = np.searchsorted(cumulative, p.top_p) + 1  # smallest prefix reaching top_p
        top = np.zeros_like(keep)
        top[order[:cutoff]] = True
        keep &= top
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs[keep].max()
    candidates = np.flatnonzero(keep)
    return candidates, probs[candidates]


_MASK64 = (1 << 64) - 1


def _draw_key(seed: int | None, position: int) -> int:
    """64 random bits for one draw: splitmix64 of (seed, position) when seeded, else fresh entropy.

    NOTE: counter-based (a pure hash of seed and position) rather than a seeded
    numpy Generator per draw, which costs ~20 us to construct.
    """
    if seed is None:
        return int(np.random.randint(0, 2**63, dtype=np.int64)) * 2 + int(np.random.randint(2))
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> np.uint32(15))
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> np.uint32(16))


def gumbel_noise(key: int, size: int) -> np.ndarray:
    """Gumbel(0, 1) noise for token ids 0..size-1 under one draw key (what the C++ kernel computes).

    Sampling = argmax(logits / T + noise): the same distribution as softmax(logits / T), and
    a different token needs the two best perturbed scores to lie within the logits' rounding
    noise, so a request recomputed in another batch (a few ulps apart) draws the same token.
    An inverse-CDF draw, by contrast, moved whenever the sum of probabilities before the
    chosen token moved across the uniform number: after a crash's recompute ~1 seeded
    stream in 16 changed.
    """
    k1, k2 = np.uint32(key & 0xFFFFFFFF), np.uint32(key >> 32)
    with np.errstate(over="ignore"):
        ids = np.arange(size, dtype=np.uint32) * np.uint32(0x9E3779B9)
        h = _mix32(_mix32(ids ^ k1) + k2)
    # NOTE: 23 bits, not 24: (2^24 - 1 + 0.5) / 2^24 rounds to 1.0 in float32, whose noise is +inf, so
    # the token hashed there won ~1 draw in 340 over a 49,152-token vocabulary whatever its probability.
    # (k + 0.5) / 2^23 is exact for every 23-bit k: u stays inside (0, 1).
    u = ((h >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 8388608.0)
    return -np.log(-np.log(u))


def score_tokens(logits: np.ndarray, token_ids, top_n: int) -> list[PromptLogprob]:
    """How each row of ``logits`` scored the token that came next (``token_ids``, one per row): its
    logprob, its rank (1 + the tokens scored strictly higher) and the top-N (id, logprob) there."""
    logprobs = _log_softmax(np.asarray(logits, dtype=np.float32))
    ids = np.asarray(token_ids, dtype=np.int64)
    chosen = logprobs[np.arange(len(ids)), ids]
    ranks = 1 + (logprobs > chosen[:, None]).sum(axis=1)
    tops = [[] for _ in ids]
    if top_n:
        candidates = np.argpartition(-logprobs, top_n - 1, axis=1)[:, :top_n]
        for row, (found, values) in enumerate(zip(candidates, logprobs, strict=True)):
            best = found[np.lexsort((found, -values[found]))]  # best first; a tie: the lower id first
            tops[row] = [(int(t), float(values[t])) for t in best]
    return [
        PromptLogprob(int(t), float(lp), int(rank), top)
        for t, lp, rank, top in zip(ids, chosen, ranks, tops, strict=True)
    ]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _result(token: int, row_logprobs: np.ndarray, top_n: int | None) -> Sampled:
    top = None
    if top_n:
        best = np.argsort(-row_logprobs, kind="stable")[:top_n]
        top = [(int(t), float(row_logprobs[t])) for t in best]
    return Sampled(token, float(row_logprobs[token]), top)
