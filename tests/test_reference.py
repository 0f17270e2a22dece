"""Mechanism tests for the reference model (labkit.blocks.reference): the language is seeded, training is
reproducible bit for bit, the safetensors writer and reader agree with each other (and with the
`safetensors` package when it is installed), the shipped weights load only with their checksum,
and the trained model is far better than a random one on held-out text."""
from __future__ import annotations

import contextlib
import io
import shutil

import pytest
import torch

from labkit.cli import main
from labkit.config import MODELS, ConfigError
from labkit.blocks.model import build_model, num_params
from labkit.blocks.reference import (HELDOUT_SEED, REFERENCE_DIR, heldout, load_reference, load_weights,
                              make_corpus, perplexity, reference_record, save_weights, sha256,
                              train_reference, write_reference)

SHORT = {"steps": 3, "batch_size": 2, "seq_len": 16, "lr": 3e-3}


def call(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_corpus_is_seeded_and_in_vocabulary():
    a, b = make_corpus(4, 64, seed=0), make_corpus(4, 64, seed=0)
    assert a.dtype == torch.long and a.shape == (4, 64)
    assert torch.equal(a, b)
    assert not torch.equal(a, make_corpus(4, 64, seed=1))
    assert not torch.equal(a, heldout(4, 64))
    assert (a[:, 0] == 0).all() and a.min() >= 0 and a.max() < MODELS["reference"].vocab_size


def _short_run(tmp_path, seed: int, name: str) -> str:
    model, stats = train_reference(seed=seed, **SHORT)
    return write_reference(model, stats, tmp_path / name)["sha256"]


@pytest.mark.slow
def test_training_is_reproducible(tmp_path):
    first = _short_run(tmp_path, 0, "a")
    assert _short_run(tmp_path, 0, "b") == first
    assert _short_run(tmp_path, 1, "c") != first
    assert sha256(tmp_path / "a" / "reference.safetensors") == first


def test_training_refuses_the_heldout_seed():
    with pytest.raises(ConfigError, match="held-out"):
        train_reference(seed=HELDOUT_SEED, **SHORT)


def _mixed_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"b.weight": torch.randn(3, 5, generator=gen),
            "a.half": torch.randn(7, generator=gen).half(),
            "a.bf16": torch.randn(2, 2, generator=gen).bfloat16(),
            "c.ids": torch.arange(6).reshape(2, 3),
            "d.scalar": torch.tensor(1.5),
            "e.empty": torch.empty(0, 4)}


def test_writer_and_reader_round_trip_exactly(tmp_path):
    state = _mixed_state()
    save_weights(state, tmp_path / "w.safetensors", {"note": "x"})
    loaded = load_weights(tmp_path / "w.safetensors")
    assert list(loaded) == sorted(state)  # fixed order
    for name, t in state.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(loaded[name], t)
    save_weights(loaded, tmp_path / "again.safetensors", {"note": "x"})
    again = (tmp_path / "again.safetensors").read_bytes()
    assert again == (tmp_path / "w.safetensors").read_bytes()


def test_the_safetensors_package_agrees(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    safe_open = pytest.importorskip("safetensors").safe_open
    state = _mixed_state()
    save_weights(state, tmp_path / "ours.safetensors", {"note": "x"})
    theirs = st.load_file(tmp_path / "ours.safetensors")
    assert set(theirs) == set(state) and all(torch.equal(theirs[n], state[n]) for n in state)
    with safe_open(tmp_path / "ours.safetensors", framework="pt") as f:
        assert f.metadata() == {"note": "x"}
    st.save_file(state, tmp_path / "theirs.safetensors")
    ours = load_weights(tmp_path / "theirs.safetensors")
    assert all(torch.equal(ours[n], state[n]) for n in state)


def test_shipped_reference_loads_with_its_checksum():
    record = reference_record()
    assert sha256(REFERENCE_DIR / record["file"]) == record["sha256"]
    model = load_reference()
    assert num_params(model) == 857_216 and not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert load_reference(dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


@pytest.mark.slow
def test_shipped_reference_is_far_better_than_random():
    """The recorded held-out perplexity is reproduced here, and is < 1/10 of a random model's."""
    record = reference_record()
    tokens = heldout(record["heldout_sequences"], record["seq_len"])
    trained = perplexity(load_reference(), tokens)
    random_init = perplexity(build_model(MODELS["reference"], seed=record["seed"]), tokens)
    assert trained == pytest.approx(record["heldout_ppl"], rel=1e-3)
    assert random_init == pytest.approx(record["random_init_ppl"], rel=1e-3)
    assert trained < random_init / 10


def test_shipped_reference_predicts_the_deterministic_tokens():
    """Greedy next tokens on held-out text are mostly right (copies, counts, recalls, agreement)."""
    tokens = heldout(8, 256)
    with torch.no_grad():
        guess = load_reference()(tokens[:, :-1]).argmax(-1)
    assert (guess == tokens[:, 1:]).float().mean() > 0.5


def test_cli_train_reference_quick(tmp_path):
    rc, out, _ = call(["train-reference", "--quick", "--out", str(tmp_path)])
    assert rc == 0
    checksum = sha256(tmp_path / "reference.safetensors")
    assert checksum in out and "perplexity" in out
    assert reference_record(tmp_path)["sha256"] == checksum
    assert num_params(load_reference(folder=tmp_path)) == 857_216


def test_tampered_or_missing_weights_are_refused(tmp_path):
    shutil.copytree(REFERENCE_DIR, tmp_path / "ref")
    path = tmp_path / "ref" / "reference.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="checksum") as err:
        load_reference(folder=tmp_path / "ref")
    assert "\n" not in str(err.value) and "labkit train-reference" in str(err.value)
    path.unlink()
    with pytest.raises(ConfigError, match="labkit train-reference"):
        load_reference(folder=tmp_path / "ref")
    with pytest.raises(ConfigError, match="labkit train-reference"):
        load_reference(folder=tmp_path / "nowhere")
