"""What the sampler records of one sampled token's logprobs.

Its own module, free of numpy and Paddle: the requests' messages carry it
(``core/request.py``), and the server's front end reads them without the
sampler (:mod:`structllm.model.sampler` computes it).
"""

from __future__ import annotations

import attrs

__all__ = ["TokenLogprobs"]


@attrs.frozen
class TokenLogprobs:
    """Logprobs of one sampled token, from the raw model distribution."""

    sampled_logprob: float
    #: 1 + the number of tokens with a strictly greater logprob
    sampled_rank: int
    #: the ``params.logprobs`` most likely tokens, most likely first
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]
