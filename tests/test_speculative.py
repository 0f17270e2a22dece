import dataclasses
import shutil

import pytest
import torch

from conftest import FAST, by

from labkit.blocks import reference as ref
from labkit.blocks import speculative as spec
from labkit.blocks.model import build_model
from labkit.config import MODELS, ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import speculative
from labkit.techniques.kv_cache import generate_cached

SIZES = {**FAST, "num_layers": 2, "prompt_len": 8, "new_tokens": 10, "num_prompts": 1}
SHAPE = dataclasses.replace(MODELS["tiny"], num_layers=2, hidden_size=64, num_heads=4,
                            num_kv_heads=2, ffn_size=128, vocab_size=512)
K = 3  # num_speculative in the direct tests


@pytest.fixture(scope="module")
def model():
    return build_model(SHAPE, seed=0).eval()


@pytest.fixture(scope="module")
def prompt():
    return ref.heldout(1, 12)


@pytest.fixture(scope="module")
def greedy(model, prompt):
    return generate_cached(model, prompt, 9, spec.make_cache(model, 32))


class Scripted:
    """Proposes the continuation of `tokens` (the greedy ones: an oracle) after a given prompt,
    shifted by `offset` in the vocabulary (offset 1: always wrong)."""

    def __init__(self, prompt_len: int, tokens: list[int], offset: int = 0):
        self.prompt_len, self.tokens, self.offset = prompt_len, tokens, offset

    def __call__(self, seq, k):
        done = len(seq) - self.prompt_len
        return [(t + self.offset) % SHAPE.vocab_size for t in self.tokens[done:done + k]]

    def reset(self):
        pass


def test_oracle_proposals_are_all_accepted_k_plus_one_tokens_per_step(model, prompt, greedy):
    oracle = Scripted(prompt.shape[1], greedy[0].tolist())
    tokens, stats = spec.generate_speculative(model, prompt, 9, oracle, K)
    assert torch.equal(tokens, greedy)
    # 9 tokens: the prefill's, then two verify steps of K guesses + the target's own: 1 + 4 + 4
    assert stats.proposal_lens == [0, K, K] and stats.accepted == [0, K, K]
    assert [a + 1 for a in stats.accepted[1:]] == [K + 1, K + 1]  # tokens per verify step
    assert spec.alpha_estimate(stats) == 1.0


def test_wrong_proposals_accept_nothing_one_token_per_step_same_tokens(model, prompt, greedy):
    wrong = Scripted(prompt.shape[1], greedy[0].tolist(), offset=1)
    tokens, stats = spec.generate_speculative(model, prompt, 9, wrong, K)
    assert torch.equal(tokens, greedy)
    assert stats.num_accepted == 0 and stats.num_steps == 9  # one token per target forward
    # each guessing step has its first guess judged; the prefill and the last step (1 token
    # wanted) guess nothing: 9 - 2
    assert stats.num_examined == 7


def test_draft_and_lookup_proposers_give_the_greedy_tokens(model, prompt, greedy):
    draft = build_model(dataclasses.replace(SHAPE, num_layers=1), seed=5).eval()
    for proposer in (spec.DraftProposer(draft, 32), spec.PromptLookup(2)):
        tokens, _ = spec.generate_speculative(model, prompt, 9, proposer, K)
        assert torch.equal(tokens, greedy)


def test_a_draft_that_is_the_target_is_always_accepted(model, prompt, greedy):
    tokens, stats = spec.generate_speculative(model, prompt, 9, spec.DraftProposer(model, 32), K)
    assert torch.equal(tokens, greedy) and stats.num_accepted == stats.num_proposed


@torch.inference_mode()
def test_a_rewound_cache_is_a_fresh_cache_of_that_length(model, prompt):
    cache, fresh = spec.make_cache(model, 32), spec.make_cache(model, 32)
    for c in (cache, fresh):
        model(prompt[:, :6], cache=c)
    model(prompt[:, 6:], start_pos=6, cache=cache)  # 6 positions more, then undone
    cache.rewind(6)
    assert cache.length == 6 and cache.num_tokens == 6
    new = prompt[:, 6:9].flip(1)  # other tokens where the rewound ones were
    got, want = model(new, start_pos=6, cache=cache), model(new, start_pos=6, cache=fresh)
    assert torch.equal(got, want)
    with pytest.raises(ValueError):
        cache.rewind(10)


def test_leviathan_formula_values():
    assert spec.expected_tokens_per_step(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)  # 3.3616
    assert spec.expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    assert spec.expected_tokens_per_step(1.0, 4) == 5.0
    assert spec.expected_tokens_per_step(0.0, 4) == 1.0
    assert spec.expected_speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    stats = spec.SpecStats([0, 2, 2], [0, 2, 1])  # examined: 2, then 1 accepted + 1 rejected
    assert stats.num_examined == 4 and spec.alpha_estimate(stats) == 0.75
    assert spec.predicted_tokens_per_step(stats, 0.5) == pytest.approx((1 + 1.75 + 1.75) / 3)


def test_ngram_lookup_finds_the_latest_match():
    seq = [1, 2, 3, 9, 4, 1, 2, 3, 7, 5, 1, 2, 3]
    assert spec.lookup(seq, 3, 2) == [7, 5]  # not [9, 4]: the later occurrence wins
    assert spec.lookup(seq, 3, 10) == [7, 5, 1, 2, 3]  # up to the end of the text
    assert spec.lookup([5, 6, 7, 8], 2, 3) == []  # no earlier occurrence
    assert spec.lookup([1, 2, 1, 2], 2, 0) == []
    assert spec.PromptLookup(ngram=3)([8, 1, 4, 6, 9, 1], 2) == [4, 6]  # falls back to 1-gram
    assert spec.PromptLookup(ngram=3, min_ngram=2)([8, 1, 4, 6, 9, 1], 2) == []


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_the_draft_checksum_is_verified(tmp_path, damage):
    for name in ("draft.json", "draft.safetensors"):
        shutil.copy(ref.REFERENCE_DIR / name, tmp_path / name)
    assert ref.load_reference(folder=tmp_path, name="draft").cfg == ref.SHAPES["draft"]
    weights = tmp_path / "draft.safetensors"
    if damage == "missing":
        weights.unlink()
    else:
        raw = bytearray(weights.read_bytes())
        raw[-1] ^= 0xFF
        weights.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="labkit train-reference --draft"):
        ref.load_reference(folder=tmp_path, name="draft")


def test_the_shipped_draft_is_its_recorded_training():
    record = ref.reference_record(name="draft")
    assert record["sha256"] == ref.sha256(ref.REFERENCE_DIR / "draft.safetensors")
    assert record["command"] == "labkit train-reference --draft" and record["model"] == "draft"
    assert record["heldout_ppl"] < record["random_init_ppl"] / 10


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return run_experiment("speculative", preset="tiny", overrides=SIZES, progress=False,
                          runs_dir=str(tmp_path_factory.mktemp("runs"))).rows


def test_every_variant_gives_the_reference_tokens_and_its_step_rows(rows):
    assert all(r["status"] in ("ok", "skipped") for r in rows), [r["message"] for r in rows]
    for variant in speculative.VARIANTS:
        assert by(rows, variant, "token_agreement")["value"] == 1.0
    assert by(rows, "none", "tokens_per_step")["value"] == 1.0
    for variant in ("draft", "prompt_lookup"):
        per_step = by(rows, variant, "tokens_per_step")
        forwards = by(rows, variant, "num_target_forwards")["value"]
        assert per_step["value"] == pytest.approx(10 / forwards)
        assert 1.0 <= per_step["predicted"] <= 4 + 1  # num_speculative (4) + its own token
        assert by(rows, variant, "speedup")["predicted"] > 0


def test_reference_preset_with_the_trained_draft(tmp_path):
    sizes = {**FAST, "prompt_len": 16, "new_tokens": 16, "num_prompts": 1}
    rows = run_experiment("speculative", preset="reference", overrides=sizes, progress=False,
                          variants=["draft"], runs_dir=str(tmp_path)).rows
    assert by(rows, "draft", "token_agreement")["value"] == 1.0
    assert by(rows, "draft", "acceptance_rate")["value"] > 0  # a trained draft agrees sometimes


def test_compare_relaxes_only_below_float32_and_only_at_a_near_tie():
    cfg = resolve(speculative.Config, "tiny", {"dtype": "bfloat16"}, experiment="speculative")
    reference = {"tokens": torch.tensor([[1, 2, 3, 4]]),
                 "top2_gap": torch.tensor([[5.0, 0.1, 5.0, 5.0]])}
    at_tie = {"tokens": torch.tensor([[1, 2, 9, 9]])}  # first differs at index 2: gap 5, no tie
    assert not speculative.compare(reference, at_tie, cfg).ok
    near = {"tokens": torch.tensor([[1, 7, 9, 9]])}  # first differs at index 1: a near-tie
    result = speculative.compare(reference, near, cfg)
    assert result.ok and result.metrics["token_agreement"] == 0.25
    fp32 = resolve(speculative.Config, "tiny", {}, experiment="speculative")
    assert not speculative.compare({"tokens": reference["tokens"]}, near, fp32).ok


def test_batched_decoding_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="batch_size=1"):
        run_experiment("speculative", preset="tiny", overrides={**SIZES, "batch_size": 2},
                       progress=False)


def test_exercises_grade_the_formula_and_the_run_has_their_evidence(tmp_path):
    from labkit.study.exercises import speculative as spec_ex
    from labkit.study.exercises.core import Rows, Setup, grade
    from labkit.study.exercises.runs import RUNS

    run = RUNS["spec"]
    setup = Setup(run, "cpu")
    rows = Rows(run_experiment(run.experiment, preset="tiny", overrides=run.overrides,
                               variants=list(run.variants), progress=False,
                               runs_dir=str(tmp_path)).rows, "test")
    exercises = {ex.key: ex for ex in spec_ex.build_exercises()}
    assert exercises["spec_tokens_per_step"].answer(setup) == pytest.approx(3.3616)  # k = 4
    assert exercises["spec_draft_speedup"].answer(setup) == pytest.approx(3.3616 / 3)
    for ex in exercises.values():
        answer = ex.answer(setup)
        assert grade(ex, answer, answer) and not grade(ex, ex.mistake(setup), answer)
        evidence = ex.evidence(rows, setup)
        assert all(v is not None and "None" not in str(v) for v in evidence.values()), evidence
        ex.why.format(answer=answer, prediction=answer, **evidence)
