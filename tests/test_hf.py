"""Hugging Face causal LMs on labkit's decoder (labkit.blocks.hf), held to transformers itself:
logits, parameter counts, KV-cache bytes and greedy tokens, for models transformers builds from
configs written here (random weights, CPU, fp32; nothing is downloaded)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import measured, needs

from labkit import cli, planner
from labkit.blocks import hf
from labkit.blocks.kv_caches import DynamicCache
from labkit.blocks.model import build_model, num_params, rope_tables
from labkit.config import MODELS, ConfigError, resolve
from labkit.reference import load_reference
from labkit.techniques.kv_cache import Config as KVConfig, generate_cached

pytestmark = needs("transformers")
# transformers' import (2.5 s here, paid by a worker's first test that builds one of its models)
# makes every test that builds one slow: `-m "not slow"` never imports it

TOL = 1e-5  # fp32 rounding: the same operations, at most in another order
SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}
CONFIGS = {  # config.json as the Hub ships them (the older rope_theta / rope_scaling spelling)
    "llama": {"model_type": "llama", **SMALL, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    # original context 32 with head_dim 16: some wavelengths kept, some stretched, some between
    "llama3": {"model_type": "llama", **SMALL, "rope_theta": 10000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    "mistral": {"model_type": "mistral", **SMALL, "num_key_value_heads": 1, "sliding_window": 16},
    "qwen2": {"model_type": "qwen2", **SMALL, "tie_word_embeddings": True},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128,
             "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0},
    # mixture of experts (labkit.blocks.moe), dropless as transformers runs them
    "mixtral": {"model_type": "mixtral", **SMALL, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"model_type": "qwen2_moe", **SMALL, "moe_intermediate_size": 32, "num_experts": 4,
                  "num_experts_per_tok": 2, "shared_expert_intermediate_size": 80},
}
# Mixtral-8x7B's published config.json (mistralai/Mixtral-8x7B-v0.1)
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "vocab_size": 32000, "max_position_embeddings": 32768, "num_local_experts": 8,
                "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_folder(folder, config: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def hf_model(folder, seed: int = 0):
    """transformers' own model for the folder's config, every weight perturbed (so zero biases
    and unit norms are not the only values a mapping is checked on)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def labkit_twin(model, cfg):
    ours = build_model(cfg)
    ours.load_state_dict(hf.from_hf(model.state_dict(), cfg))
    return ours.eval()


def hf_greedy(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """transformers' greedy decoding of `new` tokens. No end-of-sequence token: it would stop
    early, and min_new_tokens would instead forbid it (llama's default eos is token 2)."""
    model.generation_config.eos_token_id = None
    out = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[:, prompt.shape[1]:]


def cache_tensors(cache) -> list[torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [*cache.key_cache, *cache.value_cache]


@pytest.fixture(params=list(CONFIGS))
def pair(request, tmp_path):
    folder = write_folder(tmp_path / request.param, CONFIGS[request.param])
    cfg = hf.model_config(folder)
    model = hf_model(folder)
    return request.param, cfg, model, labkit_twin(model, cfg)


@pytest.mark.slow
@torch.no_grad()
def test_logits_match_transformers(pair):
    name, cfg, model, ours = pair
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len if name == "mistral" else 24))
    diff = (model(tokens).logits - ours(tokens)).abs().max().item()
    print(f"{name}: max abs logit diff {diff:.3g}")
    assert diff <= TOL


@pytest.mark.slow
def test_parameter_counts_match_transformers(pair):
    _, cfg, model, _ = pair
    theirs = sum(p.numel() for p in model.parameters())  # parameters(): tied weights once
    assert planner.num_params(cfg) == theirs == model.num_parameters()
    assert num_params(build_model(cfg, device="meta")) == theirs
    assert sum(planner.stage_tensors(cfg)) == theirs  # the per-tensor list the planner shards


@pytest.mark.slow
@torch.no_grad()
def test_kv_bytes_per_token_match_transformers_cache(pair):
    _, cfg, model, _ = pair
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    held = sum(t.numel() * t.element_size() for t in cache_tensors(model(tokens, use_cache=True).past_key_values))
    c = model.config
    heads = getattr(c, "num_key_value_heads", c.num_attention_heads)
    formula = 2 * c.num_hidden_layers * heads * (c.hidden_size // c.num_attention_heads) * 4
    assert planner.kv_bytes_per_token(cfg, "float32") == formula == held // tokens.numel()


@pytest.mark.slow
@torch.no_grad()
def test_greedy_tokens_match_transformers_generate(pair):
    _, cfg, model, ours = pair
    prompt, new = torch.randint(0, cfg.vocab_size, (2, 5)), 10
    theirs = hf_greedy(model, prompt, new)
    assert torch.equal(generate_cached(ours, prompt, new, DynamicCache(cfg.num_layers)), theirs)


@pytest.mark.slow
def test_state_dict_round_trip_into_transformers(pair):
    _, cfg, model, ours = pair
    back = hf.to_hf(ours.state_dict(), cfg)
    theirs = model.state_dict()
    assert set(back) <= set(theirs) and all(torch.equal(back[k], theirs[k]) for k in back)
    missing = set(theirs) - set(back)  # what to_hf leaves out: only buffers transformers rebuilds
    assert not missing & {n for n, _ in model.named_parameters()}


@pytest.mark.slow
def test_gpt2_files_without_prefix_or_head(tmp_path):
    """The original GPT-2 files name tensors without `transformer.` and leave the tied head out."""
    folder = write_folder(tmp_path / "gpt2", CONFIGS["gpt2"])
    cfg, model = hf.model_config(folder), hf_model(folder)
    full = model.state_dict()
    bare = {k.removeprefix("transformer."): v for k, v in full.items() if k != "lm_head.weight"}
    ours, again = hf.from_hf(full, cfg), hf.from_hf(bare, cfg)
    assert ours.keys() == again.keys() and all(torch.equal(ours[k], again[k]) for k in ours)
    with pytest.raises(ConfigError, match="lack 1 of this config"):
        hf.from_hf({k: v for k, v in full.items() if k != "transformer.ln_f.bias"}, cfg)


def test_llama3_scaling_changes_the_tables():
    """The llama3 case above would pass without the scaling if it changed nothing: it does."""
    positions = torch.arange(24)
    plain = rope_tables(positions, 16, 10000.0)
    stretched = rope_tables(positions, 16, 10000.0, (8.0, 1.0, 4.0, 32))
    assert not torch.equal(plain[0], stretched[0])


def test_config_dict_is_the_inverse(tmp_path):
    for name in CONFIGS:
        cfg = hf.model_config(write_folder(tmp_path / name, CONFIGS[name]))
        again = hf.model_config(write_folder(tmp_path / f"{name}-again", hf.config_dict(cfg)))
        assert dataclasses.replace(again, source="") == dataclasses.replace(cfg, source="")


@pytest.mark.slow
@torch.no_grad()
def test_reference_weights_in_llama_for_causal_lm(tmp_path):
    """labkit's own trained decoder, loaded into transformers' LlamaForCausalLM: same logits, and
    its caches' greedy tokens are transformers' greedy tokens."""
    import transformers

    ours = load_reference()
    folder = write_folder(tmp_path / "reference", hf.config_dict(MODELS["reference"]))
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(folder), dtype=torch.float32).eval()
    assert isinstance(model, transformers.LlamaForCausalLM)
    model.load_state_dict(hf.to_hf(ours.state_dict(), MODELS["reference"]))
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    diff = (model(tokens).logits - ours(tokens)).abs().max().item()
    print(f"reference: max abs logit diff {diff:.3g}")
    assert diff <= TOL
    prompt, new = tokens[:, :8], 24
    theirs = hf_greedy(model, prompt, new)
    assert torch.equal(generate_cached(ours, prompt, new, DynamicCache(ours.cfg.num_layers)), theirs)


@pytest.mark.slow
@torch.no_grad()
def test_sliding_window_caps_the_context(tmp_path):
    """Mistral's window (16) < its context (64): labkit's context is the window, where sliding
    attention is full causal attention; past it transformers computes something else, which is why
    longer runs are refused."""
    folder = write_folder(tmp_path / "mistral", CONFIGS["mistral"])
    cfg = hf.model_config(folder)
    assert cfg.max_seq_len == 16
    model = hf_model(folder)
    longer = labkit_twin(model, dataclasses.replace(cfg, max_seq_len=64))
    tokens = torch.randint(0, cfg.vocab_size, (1, 32))
    assert (model(tokens).logits - longer(tokens)).abs().max() > 1e-3
    with pytest.raises(ConfigError, match="longer than the model's context"):
        resolve(KVConfig, "tiny", {"model": cfg, "prompt_len": 10, "new_tokens": 10})


@pytest.mark.slow
def test_mixtral_8x7b_counts_what_transformers_builds_on_meta(tmp_path):
    """46,702,792,704 parameters, 12,879,925,248 active per token, as transformers'
    MixtralForCausalLM holds them (built on the meta device: nothing allocated); labkit's own
    decoder and planner.MIXTRAL_8X7B the same."""
    import transformers

    folder = write_folder(tmp_path / "mixtral", MIXTRAL_8X7B)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(transformers.AutoConfig.from_pretrained(folder))
    cfg = hf.model_config(folder)
    assert sum(p.numel() for p in model.parameters()) == planner.num_params(cfg) == 46_702_792_704
    assert num_params(build_model(cfg, device="meta")) == 46_702_792_704
    experts = model.model.layers[0].mlp.experts  # each token uses 2 of the 8
    unused = 32 * 6 * (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel())
    assert planner.active_params(cfg) == 46_702_792_704 - unused == 12_879_925_248
    assert dataclasses.replace(cfg, source="") == planner.MIXTRAL_8X7B


@pytest.mark.parametrize("config, words", [
    ({"model_type": "phi3", **SMALL}, "valid: llama, mistral, qwen2, gpt2"),
    ({**CONFIGS["qwen2_moe"], "mlp_only_layers": [1]}, "decoder_sparse_step=1"),
    ({**CONFIGS["mixtral"], "router_jitter_noise": 0.1}, "router_jitter_noise"),
    ({**CONFIGS["llama"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "supported: default, llama3"),
    ({**CONFIGS["llama"], "head_dim": 32}, "head_dim=32"),
    ({**CONFIGS["llama"], "attention_bias": True}, "attention_bias"),
    ({**CONFIGS["gpt2"], "activation_function": "relu"}, "gelu_new"),
    ({"model_type": "llama"}, "hidden_size"),
])
def test_refused_with_one_line(tmp_path, config, words):
    with pytest.raises(ConfigError, match=words) as e:
        hf.model_config(write_folder(tmp_path / "m", config))
    assert "\n" not in str(e.value)


def test_bad_folders_are_one_line(tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    (tmp_path / "empty").mkdir()
    for folder, words in ((tmp_path / "nope", "no such folder"), (tmp_path / "empty", "no config.json"),
                          (tmp_path / "bad", "not a readable JSON")):
        assert cli.main(["plan", "--hf-model", str(folder)]) == cli.EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1


@pytest.mark.slow
def test_safetensors_weights_load_while_the_shape_is_unchanged(tmp_path):
    """A folder save_pretrained wrote (transformers' current config.json spelling, safetensors
    weights): build_model gives its weights; shrunk through --set, random ones."""
    model = hf_model(write_folder(tmp_path / "src", CONFIGS["qwen2"]))
    model.save_pretrained(tmp_path / "saved")
    cfg = hf.model_config(tmp_path / "saved")
    tokens = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        assert (model(tokens).logits - build_model(cfg).eval()(tokens)).abs().max() <= TOL
    shrunk = resolve(KVConfig, "tiny", {"model": cfg, "num_layers": "1", "new_tokens": "8"}).model
    assert shrunk.source == cfg.source and not hf.maybe_load_weights(build_model(shrunk))


@pytest.mark.slow
def test_plan_json_counts_what_transformers_holds(tmp_path, capsys):
    for name in ("qwen2", "gpt2"):
        folder = write_folder(tmp_path / name, CONFIGS[name])
        assert cli.main(["plan", "--hf-model", str(folder), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        model = hf_model(folder)
        c = model.config
        assert report["num_params"] == model.num_parameters()
        kv_heads = getattr(c, "num_key_value_heads", c.num_attention_heads)
        bf16 = 2  # --precision mixed (the default): 16-bit weights, so a bf16 cache
        assert report["kv_cache_bytes_per_token"] == (2 * c.num_hidden_layers * kv_heads
                                                      * (c.hidden_size // c.num_attention_heads) * bf16)
        assert report["per_gpu"]["total_bytes"] > 0 and report["inputs"]["seq_len"] == 64
        assert cli.main(["plan", "--model", "tiny", "--json"]) == 0
        preset = json.loads(capsys.readouterr().out)  # the same object as for a preset
        assert report.keys() == preset.keys() and report["per_gpu"].keys() == preset["per_gpu"].keys()
    assert cli.main(["plan", "--hf-model", str(folder), "--model", "tiny"]) == cli.EXIT_BAD_INPUT


@pytest.mark.slow
def test_run_kv_cache_on_a_shrunk_qwen2(tmp_path, capsys):
    folder = write_folder(tmp_path / "qwen2", {**CONFIGS["qwen2"], "num_hidden_layers": 4})
    code = cli.main(["run", "kv_cache", "--preset", "tiny", "--hf-model", str(folder), "--set",
                     "num_layers=2", "--set", "prompt_len=8", "--set", "new_tokens=8", "--set",
                     "min_run_time_s=0", "--variant", "dynamic", "--runs-dir", str(tmp_path / "runs"),
                     "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and {r["status"] for r in measured(rows)} == {"ok"}
    model = rows[0]["params"]["model"]
    assert model["num_layers"] == 2 and model["qkv_bias"] and model["hidden_size"] == 64
