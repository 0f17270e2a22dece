import dataclasses

import pytest
import torch

from labkit import planner
from labkit.config import MODELS
from labkit.blocks.model import build_model, num_params
from labkit.techniques.kv_cache import DynamicCache

# Published parameter counts (tied GPT-2 embeddings counted once).
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_real_shapes_have_the_published_parameter_count_on_meta(preset):
    model = build_model(MODELS[preset], device="meta")
    assert num_params(model) == PUBLISHED[preset]
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing allocated
    assert planner.num_params(MODELS[preset]) == PUBLISHED[preset]


@pytest.mark.slow
def test_planner_counts_every_preset_like_the_module():
    for cfg in MODELS.values():
        assert planner.num_params(cfg) == num_params(build_model(cfg, device="meta"))


def small(arch: str):
    base = MODELS["tiny"] if arch == "llama" else MODELS["gpt2-124m"]
    return dataclasses.replace(base, num_layers=2, hidden_size=64, num_heads=4,
                               num_kv_heads=2 if arch == "llama" else 4, ffn_size=96,
                               vocab_size=100, max_seq_len=64)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_naive_and_sdpa_attention_agree(arch):
    tokens = torch.randint(0, 100, (2, 12))
    sdpa = build_model(small(arch), attention="sdpa")
    naive = build_model(small(arch), attention="naive")
    torch.testing.assert_close(sdpa(tokens), naive(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("attention", ["sdpa", "naive"])
def test_cached_decoding_matches_the_full_forward(arch, attention):
    model = build_model(small(arch), attention=attention)
    tokens = torch.randint(0, 100, (2, 10))
    full = model(tokens)
    cache = DynamicCache(2)
    parts = [model(tokens[:, :6], cache=cache)]  # a prefill, then a chunk, then single tokens
    parts.append(model(tokens[:, 6:8], start_pos=6, cache=cache))
    parts += [model(tokens[:, i:i + 1], start_pos=i, cache=cache) for i in (8, 9)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.num_tokens == 2 * 10
    assert cache.keys[0].shape == (2, small(arch).num_kv_heads, 10, 16)


def test_same_seed_same_weights_and_dtype():
    a, b = build_model(small("llama"), seed=3), build_model(small("llama"), seed=3)
    c = build_model(small("llama"), seed=4, dtype=torch.bfloat16)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert all(p.dtype == torch.bfloat16 for p in c.parameters())
    assert not torch.equal(a.embed.weight, c.embed.weight.float())


def test_tied_embeddings_share_one_tensor():
    model = build_model(small("gpt2"))
    assert model.lm_head.weight is model.embed.weight


def test_last_only_projects_one_position():
    model = build_model(small("llama"))
    tokens = torch.randint(0, 100, (3, 7))
    out = model(tokens, last_only=True)
    assert out.shape == (3, 1, 100)
    torch.testing.assert_close(out, model(tokens)[:, -1:], rtol=1e-5, atol=1e-5)
