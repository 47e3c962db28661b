"""Reproducible sentencepiece training for the tiny from-scratch models.

Same corpus + same arguments -> byte-identical ``.model`` (sentencepiece is deterministic with one thread and a
fixed generator seed; the input order is the caller's list order, and ``input_sentence_size=0`` disables sampling).
Special ids: pad 0, unk 1, bos 2, eos 3. ``byte_fallback`` makes every UTF-8 string round-trip; ``split_digits``
gives one token per digit (arithmetic-friendly); ``\\boxed`` and friends are single pieces.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence

import sentencepiece as spm

DEFAULT_USER_SYMBOLS = ("\\boxed", "\\frac", "\\sqrt", "\\cdot", "\\times", "####", "<think>", "</think>")


def train_sentencepiece(
    texts: Iterable[str],
    vocab_size: int,
    out_path: str | None = None,
    seed: int = 0,
    *,
    model_type: str = "bpe",
    user_defined_symbols: Sequence[str] = DEFAULT_USER_SYMBOLS,
) -> str | bytes:
  """Train a sentencepiece model on ``texts``.

  Args:
    texts: training sentences (str). Order matters for byte-identical output.
    vocab_size: pieces in the model including the 4 specials, bytes (256 with byte_fallback) and user symbols.
    out_path: where to write the ``.model``; ``None`` returns the serialized bytes instead.
    seed: passed to ``sentencepiece.set_random_generator_seed`` before training.
    model_type: ``"bpe"`` (default) or ``"unigram"`` (unigram uses ``hard_vocab_limit=False`` on small corpora).
    user_defined_symbols: strings that always become one piece.

  Returns:
    ``out_path`` (str) or the model bytes.

  Raises:
    ValueError: empty corpus, non-str items, or ``vocab_size`` too small / too large for the corpus.
  """
  texts = list(texts)
  if not texts:
    raise ValueError("texts is empty: need a corpus to train on")
  bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
  if bad:
    raise ValueError(f"texts[{bad[0]}] is {type(texts[bad[0]]).__name__}, expected str")
  min_size = 4 + 256 + len(user_defined_symbols) + 1
  if vocab_size < min_size:
    raise ValueError(f"vocab_size={vocab_size} < {min_size} (4 specials + 256 byte pieces + user symbols + 1)")
  buf = io.BytesIO()
  spm.set_random_generator_seed(seed)
  try:
    _train(spm, texts, buf, vocab_size, model_type, user_defined_symbols)
  except RuntimeError as e:
    if "Vocabulary size" in str(e):
      raise ValueError(
          f"vocab_size={vocab_size} does not fit this corpus ({e}); lower vocab_size or add more "
          "varied text (e.g. gsm_symbolic problems)"
      ) from e
    raise
  model = buf.getvalue()
  if out_path is None:
    return model
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  with open(out_path, "wb") as f:
    f.write(model)
  return out_path


def _train(spm, texts, buf, vocab_size, model_type, user_defined_symbols):
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts),
      model_writer=buf,
      vocab_size=vocab_size,
      model_type=model_type,
      byte_fallback=True,
      split_digits=True,
      pad_id=0,
      unk_id=1,
      bos_id=2,
      eos_id=3,
      user_defined_symbols=list(user_defined_symbols),
      num_threads=1,
      input_sentence_size=0,
      shuffle_input_sentence=False,
      normalization_rule_name="identity",
      add_dummy_prefix=False,
      remove_extra_whitespaces=False,
      hard_vocab_limit=(model_type == "bpe"),
      max_sentence_length=1 << 16,
      minloglevel=2,
  )
