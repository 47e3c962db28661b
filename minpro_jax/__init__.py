"""minpro_jax: off-policy RL of language models on math with verifiable rewards.

Implements MinPRO (Minimum Prefix Ratio, arXiv 2601.22718) and MIPU (arXiv 2606.29526) on one
JAX/Flax NNX learner; see README.md for the map of modules.
"""

__version__ = "0.1.0"
