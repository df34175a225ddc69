"""`jaxattn.models.Llama` against Hugging Face transformers' `LlamaForCausalLM` with the
same random weights (float32, CPU): logits of a right-padded batch, with and without
Llama-3 RoPE scaling (plus tied embeddings and biases), and greedy decoding against
`generate(do_sample=False)`. Skipped when torch or transformers are not installed
(`pip install -e ".[interop]"`)."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.models import Llama, LlamaConfig, load_hf_state_dict

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    bos_token_id=None,
    eos_token_id=None,  # generate runs all its new tokens
    pad_token_id=0,
)
# Llama 3.1's scaling with a 16-token original context, so that it changes every
# frequency at the test's positions (theta 5e5, D 16: wavelengths 6.3, 32, 167, ...).
LLAMA3 = dict(
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    ),
    tie_word_embeddings=True,
    attention_bias=True,
    mlp_bias=True,
)
VARIANTS = {"plain": {}, "llama3_tied_bias": LLAMA3}
PROMPT_LENS = (9, 4, 7)
LOGITS_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(autouse=True)
def float32_matmuls():
    """Full float32 projections (a GPU's default is TF32, ~1e-3 relative)."""
    with jax.default_matmul_precision("highest"):
        yield


def hf_model(overrides: dict):
    """A tiny LlamaForCausalLM with seeded weights at a scale that keeps logits O(1)
    (HF's init, std 0.02, gives near-uniform logits) and norm scales away from 1."""
    config = transformers.LlamaConfig(**TINY, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request):
    hf = hf_model(VARIANTS[request.param])
    config = LlamaConfig.from_hf(hf.config)
    return hf, load_hf_state_dict(config, hf.state_dict())


def prompts(seed: int = 0):
    """Right-padded int32 tokens `[B, T]` (pad 0) and their lengths `[B]`."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(PROMPT_LENS), max(PROMPT_LENS)), np.int64)
    for b, n in enumerate(PROMPT_LENS):
        tokens[b, :n] = rng.integers(1, TINY["vocab_size"], n)
    return tokens, np.array(PROMPT_LENS)


@nnx.jit
def forward(model, tokens, lengths):
    return model(tokens, q_lengths=lengths)


@pytest.mark.every_case
def test_config_from_hf(models):
    hf, model = models
    config = model.config
    assert (config.num_layers, config.num_q_heads, config.num_kv_heads, config.head_dim) == (
        2, 4, 2, 16)  # fmt: skip
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert LlamaConfig.from_hf(hf.config.to_dict()) == config  # a config.json dict as well
    if config.rope_scaling is not None:
        assert config.rope_scaling.original_max_position_embeddings == 16


@pytest.mark.parametrize("kind", [dict(rope_type="yarn", factor=4.0),
                                  dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0)], ids=["yarn", "llama3"])  # fmt: skip
@pytest.mark.every_case
def test_config_json_top_level_original_context(kind):
    """A config.json's own `original_max_position_embeddings` takes precedence over
    `max_position_embeddings` for yarn and llama3, as transformers reads it (the dict had
    taken 4096: frequencies up to 2x off); the frequencies equal transformers'."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = dict(vocab_size=10, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=4, max_position_embeddings=4096, rope_theta=500000.0,
               original_max_position_embeddings=512, rope_scaling=kind)  # fmt: skip
    hf = transformers.LlamaConfig(**copy.deepcopy(cfg))  # (it edits nested dicts)
    want = LlamaRotaryEmbedding(hf).inv_freq.double().numpy()
    for source in (hf, cfg):
        got = np.asarray(LlamaConfig.from_hf(source).rope.inv_freq(16), np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
@pytest.mark.every_case
def test_config_refuses_partial_rotary(where):
    """Partial rotary is not this model's: refused wherever the config puts it (4.x
    configs keep it at the top level, 5.x in `rope_parameters`)."""
    cfg = dict(vocab_size=10, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=4)  # fmt: skip
    if where == "top":
        cfg["partial_rotary_factor"] = 0.5
    else:
        cfg["rope_parameters"] = dict(
            rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5
        )
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        LlamaConfig.from_hf(cfg)
    cfg.pop("partial_rotary_factor", None)
    cfg.pop("rope_parameters", None)
    assert LlamaConfig.from_hf(dict(cfg, partial_rotary_factor=1.0)).head_dim == 16


def test_mistral_sliding_window_matches_transformers():
    """Mistral's `sliding_window` (Llama's weights otherwise) becomes each layer's window:
    logits past the window equal transformers' (it had been dropped: the model attended
    to the whole prefix)."""
    cfg = transformers.MistralConfig(**dict(TINY, num_hidden_layers=1, sliding_window=3))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(cfg).eval()
    config = LlamaConfig.from_hf(hf.config)
    assert config.sliding_window == 3
    model = load_hf_state_dict(config, hf.state_dict())
    tokens = np.random.default_rng(0).integers(1, TINY["vocab_size"], (1, 10))
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens, jnp.int32))), want,
                               **LOGITS_TOL)  # fmt: skip


def test_sliding_window_on_some_layers_is_refused():
    """Qwen2-style windows: off without `use_sliding_window`; on every layer, or on none,
    from `max_window_layers` (4.x) or `layer_types`; on some layers only, refused."""
    base = dict(vocab_size=10, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, sliding_window=8)  # fmt: skip
    window = lambda **kw: LlamaConfig.from_hf(dict(base, **kw)).sliding_window  # noqa: E731
    assert window() == 8
    assert window(use_sliding_window=False) is None
    assert window(use_sliding_window=True, max_window_layers=0) == 8
    assert window(use_sliding_window=True, max_window_layers=2) is None
    assert window(layer_types=["full_attention"] * 2) is None
    for kw in (dict(use_sliding_window=True, max_window_layers=1),
               dict(layer_types=["full_attention", "sliding_attention"])):  # fmt: skip
        with pytest.raises(ValueError, match="sliding_window=8 on some layers only"):
            window(**kw)
    # A Qwen config.json leaving keys out takes transformers' defaults: no window unless
    # use_sliding_window, and then from layer 28 on (none of these 2).
    for model_type in ("qwen2", "qwen3"):
        assert window(model_type=model_type) is None
        assert window(model_type=model_type, use_sliding_window=True) is None
        hf = transformers.AutoConfig.for_model(
            model_type, **base, num_key_value_heads=4, use_sliding_window=True
        )
        assert LlamaConfig.from_hf(hf).sliding_window is None


def test_logits_match_transformers(models):
    hf, model = models
    tokens, lengths = prompts()
    mask = np.arange(tokens.shape[1]) < lengths[:, None]
    with torch.no_grad():
        want = hf(
            input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask).long()
        ).logits.numpy()
    got = np.asarray(forward(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths)))
    assert np.abs(want[mask]).max() > 1  # logits far from uniform: the weights matter
    np.testing.assert_allclose(got[mask], want[mask], **LOGITS_TOL)


def test_fused_qkv_loads_the_same_model(models):
    hf, model = models
    fused = load_hf_state_dict(model.config, hf.state_dict(), fused_qkv=True)
    tokens, lengths = prompts(seed=1)
    tokens, lengths = jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths)
    mask = np.arange(tokens.shape[1]) < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(
        np.asarray(forward(fused, tokens, lengths))[mask],
        np.asarray(forward(model, tokens, lengths))[mask],
        atol=1e-5,
        rtol=1e-5,
    )


def test_greedy_decoding_matches_generate(models):
    hf, model = models
    new_tokens = 8
    tokens, lengths = prompts(seed=2)
    # HF batches prompts left-padded (generate derives positions from the mask).
    width = tokens.shape[1]
    left = np.zeros_like(tokens)
    for b, n in enumerate(lengths):
        left[b, width - n :] = tokens[b, :n]
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.from_numpy(left),
            attention_mask=torch.from_numpy(left != 0).long(),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        ).numpy()
    want = out[:, width:]
    # Full recompute: one [B, T + new_tokens] buffer (one compile), lengths grow by one.
    buf = np.zeros((len(lengths), width + new_tokens), np.int32)
    buf[:, :width] = tokens
    lens = lengths.copy()
    got = []
    for _ in range(new_tokens):
        logits = np.asarray(forward(model, jnp.asarray(buf), jnp.asarray(lens)))
        nxt = logits[np.arange(len(lens)), lens - 1].argmax(-1)
        buf[np.arange(len(lens)), lens] = nxt
        lens += 1
        got.append(nxt)
    np.testing.assert_array_equal(np.stack(got, axis=1), want)


def test_loader_names_bad_state_dicts(models):
    hf, model = models
    state = dict(hf.state_dict())
    with pytest.raises(ValueError, match="unexpected names.*extra.weight"):
        load_hf_state_dict(model.config, {**state, "extra.weight": state["model.norm.weight"]})
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj.weight.*missing"):
        load_hf_state_dict(model.config, missing)
    bad = {**state, "model.norm.weight": state["model.norm.weight"][:-1]}
    with pytest.raises(ValueError, match=r"model.norm.weight: shape \(63,\), expected \(64,\)"):
        load_hf_state_dict(model.config, bad)
    shell = nnx.eval_shape(lambda: Llama(model.config, rngs=nnx.Rngs(1)))
    assert load_hf_state_dict(shell, state) is shell  # a model is filled in place
