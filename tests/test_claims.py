"""The claims table (labkit.study.claims): every number a question states that labkit computes is
made by labkit at the question's settings, and the test fails when either side is edited by hand."""
from labkit import planner
from labkit.study import claims


def test_every_claim_is_made_by_labkit_and_stated_by_its_question():
    assert len(claims.CLAIMS) >= 50
    assert claims.check() == []


def test_a_number_changed_by_hand_in_the_text_or_the_table_fails(monkeypatch):
    words = claims.texts()
    monkeypatch.setattr(claims, "texts", lambda: {**words, "cp-01": words["cp-01"].replace("640 MiB", "650 MiB")})
    assert claims.check() == ["cp-01: its text no longer says '640 MiB'"]
    edited = [c._replace(number="650 MiB") if c.number == "640 MiB" and c.text == "cp-01" else c
              for c in claims.CLAIMS]
    assert "cp-01: labkit makes '640 MiB', the table says '650 MiB'" in claims.check(edited)


def test_the_shapes_behind_the_claims():
    """What the cp- and zb- explanations say of the formulas, beside their numbers."""
    shard = [planner.cp_block_bytes(1, 32, 16384 * n, 128, n, e=2) for n in (2, 4, 8)]
    ulysses = [planner.ulysses_all_to_all_bytes(1, 32, 8, 16384 * n, 128, n, e=2) for n in (2, 4, 8)]
    assert len(set(shard)) == len(set(ulysses)) == 1  # constant as S and n grow together
    assert len(set(planner.causal_pairs(8192, 4, "zigzag"))) == 1  # balanced
    assert planner.int8_levels(2) == 127 // 2
