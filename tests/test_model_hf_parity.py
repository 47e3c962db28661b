"""Logit and log-prob parity with Hugging Face transformers (torch CPU, fp32) through real safetensors folders.

Each case builds a tiny randomly initialised Qwen3 / Qwen3-MoE / Llama with transformers, re-draws every weight
(norm scales included, larger than HF's init so every path matters), `save_pretrained`s it, loads it with
`load_hf_checkpoint` and compares logits on a left-padded batch; then exports with `save_hf_checkpoint`, loads
that with transformers and compares again.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from minpro_jax.models import token_logprobs  # noqa: E402
from minpro_jax.models.hf_io import config_from_hf, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

V = 97
# head_dim 16 != hidden 48 / heads 4; GQA; non-default rope_theta.
_COMMON = dict(
    vocab_size=V,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=5000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
)
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CASES = {
    "qwen3-untied": ("Qwen3", dict(_COMMON, tie_word_embeddings=False)),
    "qwen3-tied-mqa": ("Qwen3", dict(_COMMON, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3moe-norm": (
        "Qwen3Moe",
        dict(
            _COMMON,
            moe_intermediate_size=24,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3moe-nonorm-tied": (
        "Qwen3Moe",
        dict(
            _COMMON,
            moe_intermediate_size=24,
            num_experts=5,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            tie_word_embeddings=True,
        ),
    ),
    "llama-tied-rope3": (
        "Llama",
        dict(_COMMON, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_scaling=dict(_LLAMA3)),
    ),
    "llama-untied": ("Llama", dict(_COMMON, num_key_value_heads=4, tie_word_embeddings=False)),
}


def _hf_model(case):
  prefix, kw = CASES[case]
  cfg = getattr(transformers, prefix + "Config")(**kw)
  torch.manual_seed(0)
  model = getattr(transformers, prefix + "ForCausalLM")(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or "layernorm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith("mlp.gate.weight"):  # router: spread so top-k choices are clear-cut
        p.copy_(0.5 * torch.randn_like(p))
      else:
        p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
  return model


def _batch():
  """Tokens [3, 12]; row 0 left-padded by 3, row 1 full, row 2 left-padded by 7."""
  rng = np.random.RandomState(1)
  tokens = rng.randint(0, V, (3, 12)).astype(np.int32)
  pad = [3, 0, 7]
  seg = np.ones_like(tokens)
  for i, p in enumerate(pad):
    seg[i, :p] = 0
    tokens[i, :p] = 0
  return tokens, seg


def _hf_logits(model, tokens, seg):
  pos = np.maximum(np.cumsum(seg, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(
        input_ids=torch.tensor(tokens, dtype=torch.long),
        attention_mask=torch.tensor(seg),
        position_ids=torch.tensor(pos, dtype=torch.long),
    )
  return out.logits.float().numpy()


def _max_diff_real(a, b, seg):
  return float(np.abs(a - b)[seg.astype(bool)].max())


@pytest.fixture(scope="module", params=sorted(CASES))
def loaded(request, tmp_path_factory):
  case = request.param
  hf = _hf_model(case)
  path = str(tmp_path_factory.mktemp(case))
  hf.save_pretrained(path)
  model, config = load_hf_checkpoint(path)
  return case, hf, model, config, path


def test_logits_match_transformers(loaded):
  case, hf, model, config, _ = loaded
  tokens, seg = _batch()
  ref = _hf_logits(hf, tokens, seg)
  ours = np.asarray(model(jnp.asarray(tokens), segment_ids_bt=jnp.asarray(seg)).out)
  assert float(np.abs(ref[seg.astype(bool)]).std()) > 0.3, "logits too flat for a meaningful comparison"
  assert _max_diff_real(ours, ref, seg) <= 1e-4, case


def test_config_read_from_folder(loaded):
  case, hf, model, config, _ = loaded
  hc = hf.config
  assert config.head_dim == 16 and config.num_heads == 4 and config.num_kv_heads == hc.num_key_value_heads
  assert config.tie_embeddings == hc.tie_word_embeddings
  assert config.rope_theta == hc.rope_parameters["rope_theta"]
  assert config.architecture == hc.model_type
  if config.is_moe:
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (
        hc.num_experts,
        hc.num_experts_per_tok,
        hc.norm_topk_prob,
    )
  if case == "llama-tied-rope3":
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0


def test_token_logprobs_match_torch_log_softmax(loaded):
  case, hf, model, _, _ = loaded
  tokens, seg = _batch()
  ref = torch.log_softmax(torch.tensor(_hf_logits(hf, tokens, seg), dtype=torch.float64), dim=-1)
  ref_logp = torch.gather(ref[:, :-1], 2, torch.tensor(tokens[:, 1:], dtype=torch.long)[..., None])[..., 0].numpy()
  got = np.asarray(token_logprobs(model, jnp.asarray(tokens), jnp.asarray(seg), chunk_size=5).logp)
  valid = (seg[:, 1:] * seg[:, :-1]).astype(bool)  # predicted token and its context are both real
  assert float(np.abs(got[:, 1:] - ref_logp)[valid].max()) <= 2e-5, case
  assert np.all(got[:, 0] == 0)


def test_round_trip_export_loads_in_transformers(loaded, tmp_path):
  case, hf, model, config, _ = loaded
  save_hf_checkpoint(model, str(tmp_path))
  hf2 = type(hf).from_pretrained(str(tmp_path)).eval()
  tokens, seg = _batch()
  ref = _hf_logits(hf, tokens, seg)
  assert _max_diff_real(_hf_logits(hf2, tokens, seg), ref, seg) == 0.0, case  # fp32 weights copied bit-exactly
  model2, config2 = load_hf_checkpoint(str(tmp_path))
  assert config2 == config
  ours2 = np.asarray(model2(jnp.asarray(tokens), segment_ids_bt=jnp.asarray(seg)).out)
  assert _max_diff_real(ours2, ref, seg) <= 1e-4


@pytest.mark.parametrize("case", ["qwen3-untied", "qwen3moe-norm"])
def test_sharded_index_checkpoint(case, tmp_path):
  hf = _hf_model(case)
  hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")
  assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")
  assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) > 2
  model, _ = load_hf_checkpoint(str(tmp_path / "hf"))
  tokens, seg = _batch()
  ref = _hf_logits(hf, tokens, seg)
  ours = np.asarray(model(jnp.asarray(tokens), segment_ids_bt=jnp.asarray(seg)).out)
  assert _max_diff_real(ours, ref, seg) <= 1e-4
  # our own sharded export, read back by transformers
  files = save_hf_checkpoint(model, str(tmp_path / "ours"), max_shard_bytes=20_000)
  assert len(files) > 2
  index = json.load(open(tmp_path / "ours" / "model.safetensors.index.json"))
  assert set(index["weight_map"].values()) == set(files)
  hf2 = type(hf).from_pretrained(str(tmp_path / "ours")).eval()
  assert _max_diff_real(_hf_logits(hf2, tokens, seg), ref, seg) == 0.0


def test_fused_expert_layout_loads(tmp_path):
  """transformers v5 in-memory layout (experts.gate_up_proj [E, 2F, D], experts.down_proj [E, D, F])."""
  from safetensors.numpy import save_file

  hf = _hf_model("qwen3moe-norm")
  sd = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
  assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)  # what the module holds in 5.x
  save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  hf.config.to_json_file(str(tmp_path / "config.json"))
  model, _ = load_hf_checkpoint(str(tmp_path))
  tokens, seg = _batch()
  ours = np.asarray(model(jnp.asarray(tokens), segment_ids_bt=jnp.asarray(seg)).out)
  assert _max_diff_real(ours, _hf_logits(hf, tokens, seg), seg) <= 1e-4


def test_config_from_hf_rejects_unsupported():
  base = json.loads(transformers.Qwen3Config(**_COMMON).to_json_string())
  with pytest.raises(ValueError, match="model_type.*'gpt2'.*qwen3"):
    config_from_hf(dict(base, model_type="gpt2"))
  with pytest.raises(ValueError, match="attention_bias"):
    config_from_hf(dict(base, attention_bias=True))
  with pytest.raises(ValueError, match="use_sliding_window"):
    config_from_hf(dict(base, use_sliding_window=True, sliding_window=64))
  with pytest.raises(ValueError, match="hidden_act"):
    config_from_hf(dict(base, hidden_act="gelu"))
  assert config_from_hf(base, param_dtype="bfloat16", scan_layers=True).param_dtype == "bfloat16"


@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_aux_loss_matches_transformers_one_layer(norm_topk, tmp_path):
  """One MoE layer: our router_aux_loss == HF `load_balancing_loss_func` (padding masked). With several layers
  HF pools the token fractions and probabilities of all layers before the product, while we average the
  per-layer Switch losses, so only the one-layer values are comparable."""
  prefix, kw = CASES["qwen3moe-norm"]
  kw = dict(kw, num_hidden_layers=1, norm_topk_prob=norm_topk)
  cfg = transformers.Qwen3MoeConfig(**kw)
  torch.manual_seed(0)
  hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if name.endswith("mlp.gate.weight"):
        p.copy_(0.5 * torch.randn_like(p))
  hf.save_pretrained(str(tmp_path))
  model, _ = load_hf_checkpoint(str(tmp_path))
  tokens, seg = _batch()
  with torch.no_grad():
    out = hf(
        input_ids=torch.tensor(tokens, dtype=torch.long),
        attention_mask=torch.tensor(seg),
        position_ids=torch.tensor(np.maximum(np.cumsum(seg, 1) - 1, 0), dtype=torch.long),
        output_router_logits=True,
    )
  ours = float(model(jnp.asarray(tokens), segment_ids_bt=jnp.asarray(seg)).router_aux_loss)
  assert abs(ours - float(out.aux_loss)) <= 1e-5 * float(out.aux_loss)
  assert ours > cfg.num_experts_per_tok  # not the balanced minimum k: the comparison is informative
