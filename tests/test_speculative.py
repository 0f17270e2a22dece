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

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

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
    k = resolve(speculative.Config, "tiny", SIZES, experiment="speculative").num_speculative
    for variant in ("draft", "prompt_lookup"):
        per_step = by(rows, variant, "tokens_per_step")
        forwards = by(rows, variant, "num_target_forwards")["value"]
        assert per_step["value"] == pytest.approx(10 / forwards)
        assert 1.0 <= per_step["predicted"] <= k + 1  # its guesses + its own token
        # the predicted speed-up divides by a step's cost in target forwards, from the measured c:
        # the prefill proposes nothing; a lookup costs c a step, a draft c per guess (k a step,
        # fewer near the end: none where one token is left)
        c, later = by(rows, variant, "cost_ratio")["value"], (forwards - 1) / forwards
        cost = per_step["predicted"] / by(rows, variant, "speedup")["predicted"]
        if variant == "prompt_lookup":
            assert cost == pytest.approx(1 + c * later, rel=1e-9)
        else:
            lowest = 1 + c * (forwards - 2) / forwards
            assert lowest * (1 - 1e-9) <= cost <= (1 + c * k * later) * (1 + 1e-9)


def test_predictions_are_leviathans_formula_at_each_steps_guesses_over_its_cost():
    """Steps: the prefill (no guess), 4 guesses all accepted, 4 with 1 accepted, 2 both accepted.
    Judged: 4 + 2 + 2 = 8 of which 7 accepted: alpha = 7/8. A step of k guesses emits
    1 + alpha + ... + alpha^k tokens on average; a draft costs c per guess, a lookup c a step."""
    stats = spec.SpecStats([0, 4, 4, 2], [0, 4, 1, 2])
    a, c = 7 / 8, 0.1
    emitted = [sum(a**j for j in range(g + 1)) for g in (0, 4, 4, 2)]
    per_step = sum(emitted) / 4
    for variant, cost in (("draft", 1 + c * 10 / 4), ("prompt_lookup", 1 + c * 3 / 4)):
        cfg = resolve(speculative.Config, "tiny", {"variant": variant}, experiment="speculative")
        got = speculative.predictions(stats, c, cfg)
        assert got == pytest.approx({"tokens_per_step": per_step, "speedup": per_step / cost})


def test_reference_preset_with_the_trained_draft(tmp_path):
    sizes = {**FAST, "prompt_len": 16, "new_tokens": 16, "num_prompts": 1}
    rows = run_experiment("speculative", preset="reference", overrides=sizes, progress=False,
                          variants=["draft"], runs_dir=str(tmp_path)).rows
    assert by(rows, "draft", "token_agreement")["value"] == 1.0
    # each target forward emits its accepted guesses and one token of its own (the prefill: one)
    forwards = by(rows, "draft", "num_target_forwards")["value"]
    accepted = sizes["new_tokens"] - forwards
    assert by(rows, "draft", "tokens_per_step")["value"] == pytest.approx(sizes["new_tokens"] / forwards)
    # accepted / proposed and accepted / judged: whole numbers of guesses, judged <= proposed <=
    # k a step; a random draft (1 / vocab per guess) would accept next to none of 15 tokens
    k = resolve(speculative.Config, "reference", sizes, experiment="speculative").num_speculative
    proposed = accepted / by(rows, "draft", "acceptance_rate")["value"]
    judged = accepted / by(rows, "draft", "alpha")["value"]
    assert proposed == pytest.approx(round(proposed)) and judged == pytest.approx(round(judged))
    assert accepted <= round(judged) <= round(proposed) <= k * (forwards - 1)
    assert accepted >= 4  # the trained draft: measured 8 of 15 here


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
    assert setup.cfg("draft").num_speculative == 4
    # computed here: alpha 0.8, k = 4: 1 + 0.8 + 0.64 + 0.512 + 0.4096 tokens a step; a draft
    # at c = 0.5 costs 1 + 4 x 0.5 = 3 target forwards a step
    careful = {"spec_tokens_per_step": 3.3616, "spec_draft_speedup": 3.3616 / 3}
    mistakes = {"spec_tokens_per_step": 1 + 0.8 * 4, "spec_draft_speedup": 3.3616}
    for key, ex in exercises.items():
        answer = ex.answer(setup)
        assert answer == pytest.approx(careful[key], rel=1e-12)
        assert grade(ex, careful[key], answer) and ex.mistake(setup) == pytest.approx(mistakes[key])
        assert not grade(ex, mistakes[key], answer)
        assert not grade(ex, careful[key] * (1 + 2 * ex.rel_tol), answer)  # off by the tolerance
        evidence = ex.evidence(rows, setup)
        assert all(v is not None and "None" not in str(v) for v in evidence.values()), evidence
        ex.why.format(answer=answer, prediction=answer, **evidence)
