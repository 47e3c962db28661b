"""Math data: problem records, sources (local files, reasoning-gym, champ), grain pipeline, prompts, sentencepiece."""

from minpro_jax.data.pipeline import ProblemLoader
from minpro_jax.data.prompts import BOXED_INSTRUCTION, PLAIN_TEMPLATE, EncodedPrompts, encode_prompts, format_prompt
from minpro_jax.data.records import DataError, LoadReport, MathProblem
from minpro_jax.data.sources import FORMATS, champ_problems, load_file, reasoning_gym_problems
from minpro_jax.data.spm import train_sentencepiece

__all__ = [
    "BOXED_INSTRUCTION",
    "DataError",
    "EncodedPrompts",
    "FORMATS",
    "LoadReport",
    "MathProblem",
    "PLAIN_TEMPLATE",
    "ProblemLoader",
    "champ_problems",
    "encode_prompts",
    "format_prompt",
    "load_file",
    "reasoning_gym_problems",
    "train_sentencepiece",
]
