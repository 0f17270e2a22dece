"""The claims table (labkit.study.claims): every number a question or a notebook's Markdown states
that labkit computes is made by labkit at the text's settings, and the test fails when either side
is edited by hand; the mechanical part of data/quiz_conventions.md holds for the bank."""
import dataclasses
from collections import Counter

import pytest

from labkit import planner
from labkit.study import claims
from labkit.study.claims import conventions
from labkit.study.quiz import load_bank


@pytest.fixture(scope="module")
def words():
    return claims.texts()


def test_every_claim_is_made_by_labkit_and_stated_by_its_text():
    assert len(claims.CLAIMS) >= 230
    assert claims.check() == []


def test_the_table_holds_every_source(words):
    by_source = Counter(claims.source(claim, words) for claim in claims.CLAIMS)
    assert by_source["question"] >= 150 and by_source["feedback"] >= 25
    assert by_source["notebook"] >= 20 and by_source["exercise text"] >= 10


def test_a_number_changed_by_hand_in_the_text_or_the_table_fails(monkeypatch, words):
    ring = [c for c in claims.CLAIMS if (c.text, c.number) == ("cp-01", "640 MiB")]
    kv = [c for c in claims.CLAIMS if c.text == "notebooks/text/02_kv_cache.md" and c.number.endswith("0.516x")]
    edited = {**words, "cp-01": {k: v.replace("640 MiB", "650 MiB") for k, v in words["cp-01"].items()},
              "notebooks/text/02_kv_cache.md": {"notebook": "0.52x"}}
    monkeypatch.setattr(claims, "texts", lambda: edited)
    assert claims.check(ring + kv) == ["cp-01: its text no longer says '640 MiB'",
                                       "notebooks/text/02_kv_cache.md: its text no longer says '(2 x head_dim): 0.516x'"]
    monkeypatch.setattr(claims, "texts", lambda: words)
    assert claims.check([ring[0]._replace(number="650 MiB")]) == [
        "cp-01: labkit makes '640 MiB', the table says '650 MiB'"]


def test_a_byte_answer_names_what_each_element_takes():
    bank = load_bank()
    assert conventions.open_dtype(bank) == []
    assert len(conventions.byte_answers(bank)) >= 40
    mem01 = next(q for q in bank if q.id == "mem-01")
    vague = dataclasses.replace(mem01, question="A 7B-parameter model trains on one GPU. How much memory do "
                                                "its weights, gradients and optimizer states take?")
    assert conventions.open_dtype([vague]) == ["mem-01"]


def test_the_shapes_behind_the_claims():
    """What the cp- and zb- explanations say of the formulas, beside their numbers."""
    shard = [planner.cp_block_bytes(1, 32, 16384 * n, 128, n, e=2) for n in (2, 4, 8)]
    ulysses = [planner.ulysses_all_to_all_bytes(1, 32, 8, 16384 * n, 128, n, e=2) for n in (2, 4, 8)]
    assert len(set(shard)) == len(set(ulysses)) == 1  # constant as S and n grow together
    assert len(set(planner.causal_pairs(8192, 4, "zigzag"))) == 1  # balanced
    assert planner.int8_levels(2) == 127 // 2
