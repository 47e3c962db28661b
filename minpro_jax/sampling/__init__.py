"""Generation: sampling parameters, the jitted KV-cache sampler and the batch it returns."""

from minpro_jax.sampling.batch import FINISH_LENGTH, FINISH_STOP, GenerationBatch
from minpro_jax.sampling.methods import NextTokens, SamplingParams, get_next_tokens, truncation_logits
from minpro_jax.sampling.paged_continuous import PagedKV
from minpro_jax.sampling.prepared import PreparedParams
from minpro_jax.sampling.sampler import Sampler

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "GenerationBatch",
    "NextTokens",
    "SamplingParams",
    "get_next_tokens",
    "truncation_logits",
    "PagedKV",
    "PreparedParams",
    "Sampler",
]
