"""Padding-free packing: the batches hold exactly the documents, no target crosses a boundary,
positions restart; the decoder's document mask is block-diagonal causal and makes each packed
document's loss and gradients those of the document alone, which the naive packing fails; the
experiment end to end; its config refusals; the quiz's figures from labkit's own computation."""
import dataclasses

import pytest
import torch

from labkit.blocks import packing
from labkit.blocks.model import build_model, document_mask, document_positions
from labkit.config import MODELS, ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import packing as exp

TINY = dataclasses.replace(MODELS["tiny"], num_layers=2)
FAST = {"min_run_time_s": 0.0, "warmup": 0}


def docs(n=7, median=9, seq_len=32, seed=0):
    return packing.draw_documents(n, median_len=median, sigma=1.0, max_len=seq_len, vocab_size=100, seed=seed)


def test_packed_rows_hold_exactly_the_documents_with_restarting_positions():
    documents = docs()
    batch = packing.pack_batch(documents, 32)
    assert batch.tokens.shape[1] == 32 and len(batch.tokens) < len(documents)
    for i, d in enumerate(documents):
        where = batch.document_ids == i
        assert where.sum() == len(d)  # placed whole, once
        row = int(where.any(dim=1).nonzero())
        assert torch.equal(batch.tokens[row][where[row]], d)
        assert torch.equal(batch.positions[row][where[row]], torch.arange(len(d)))
        # targets: the next token inside the document, none for its last token
        assert torch.equal(batch.targets[row][where[row]], packing.document_targets(d))
    pads = batch.document_ids < 0
    assert (batch.tokens[pads] == packing.PAD_ID).all() and (batch.targets[pads] == packing.IGNORE).all()
    # no target crosses a boundary: each kept target is the next token of the same document
    kept = batch.targets != packing.IGNORE
    same = torch.zeros_like(kept)
    same[:, :-1] = batch.document_ids[:, 1:] == batch.document_ids[:, :-1]
    assert not (kept & ~same).any()
    assert torch.equal(document_positions(batch.document_ids)[~pads], batch.positions[~pads])


def test_long_documents_are_split_into_row_sized_pieces_alike_in_both_layouts():
    documents = [torch.arange(1, 71), torch.arange(1, 6)]
    padded, packed = (packing.make_batch(layout, documents, 32) for layout in packing.LAYOUTS)
    assert padded.lengths == packed.lengths == (32, 32, 6, 5)
    assert sorted(padded.tokens[padded.document_ids >= 0].tolist()) == \
        sorted(packed.tokens[packed.document_ids >= 0].tolist()) == sorted(torch.cat(documents).tolist())
    with pytest.raises(ValueError, match="split_long first"):
        packing.first_fit([40], 32)


def test_padding_fraction_formula_equals_the_counted_pads():
    documents = docs(n=11, seed=3)
    lengths = [len(d) for d in documents]
    for batch in (packing.pad_batch(documents), packing.pack_batch(documents, 32)):
        rows, T = batch.tokens.shape
        counted = int((batch.tokens == packing.PAD_ID).sum())  # tokens are 1.. : 0 only in pads
        assert counted == batch.num_pad
        assert batch.padding_fraction == pytest.approx(packing.padding_fraction(lengths, rows, T), rel=1e-12)


def test_the_document_mask_is_block_diagonal_causal():
    ids = torch.tensor([[0, 0, 0, 1, 1, -1], [2, 3, 3, 3, 3, 3]])
    mask = document_mask(ids)
    assert mask.shape == (2, 1, 6, 6)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    expected[:3, :3] = torch.ones(3, 3).tril().bool()
    expected[3:5, 3:5] = torch.ones(2, 2).tril().bool()
    expected[5, 5] = True
    assert torch.equal(mask[0, 0], expected)
    assert torch.equal(document_positions(ids), torch.tensor([[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]))


def per_document(model, layout, documents, seq_len, masked):
    batch = packing.make_batch(layout, documents, seq_len)
    losses = exp.document_losses(model, batch, "cpu", masked)
    model.zero_grad(set_to_none=True)
    logits = model(batch.tokens, document_ids=batch.document_ids if masked else None)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="sum").backward()
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
    return {"document_losses": losses, "grads": grads, "loss": float(losses.mean())}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_with_the_mask_equals_each_document_alone_and_naive_fails(arch):
    m = dataclasses.replace(TINY, arch=arch, **({"tie_embeddings": True} if arch == "gpt2" else {}))
    model = build_model(m, seed=0)
    documents = packing.draw_documents(6, median_len=8, sigma=1.0, max_len=32, vocab_size=m.vocab_size, seed=1)
    with torch.no_grad():  # each document truly alone: no row, no pads
        alone = [model(d[None])[0] for d in documents]
    padded = per_document(model, "padded", documents, 32, masked=False)
    packed = per_document(model, "packed", documents, 32, masked=True)
    naive = per_document(model, "packed", documents, 32, masked=False)
    by_hand = torch.stack([torch.nn.functional.cross_entropy(a[:-1], d[1:]) for a, d in zip(alone, documents)])
    assert padded["document_losses"] == pytest.approx(by_hand.double().numpy(), rel=1e-5)
    assert exp.documents_match(padded, packed).ok
    failed = exp.documents_match(padded, naive)
    assert not failed.ok and failed.metrics["documents_isolated"] == 0.0
    assert failed.metrics["document_loss_max_rel_diff"] > 1e-3


def test_without_document_ids_the_decoder_is_unchanged():
    model = build_model(TINY, seed=0)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    ids = torch.zeros_like(tokens)  # one document per row: the plain causal case
    assert torch.allclose(model(tokens), model(tokens, document_ids=ids), atol=1e-5)
    with pytest.raises(ValueError, match="no cache"):
        model(tokens, document_ids=ids, start_pos=3)


def test_the_naive_attention_takes_the_document_mask_too():
    model = build_model(TINY, seed=0, attention="naive")
    sdpa = build_model(TINY, seed=0)
    batch = packing.pack_batch(docs(seed=5), 32)
    assert torch.allclose(model(batch.tokens, document_ids=batch.document_ids),
                          sdpa(batch.tokens, document_ids=batch.document_ids), atol=1e-5)


def test_bad_values_are_one_line_errors():
    for overrides, message in (({"median_len": 200, "seq_len": 64}, "median_len=200 is longer than a row"),
                               ({"dtype": "bfloat16"}, "valid: float32"),
                               ({"variant": "packed_flex"}, "packed_naive")):
        with pytest.raises(ConfigError, match=message) as e:
            exp.validate(resolve(exp.Config, "tiny", {"device": "cpu", **overrides}, experiment="packing"))
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_the_experiment_runs_end_to_end_with_every_row_checked(tmp_path):
    settings = {**FAST, "device": "cpu", "num_layers": 2, "batch_size": 6, "seq_len": 64}
    frame = run_experiment("packing", preset="tiny", overrides=settings, runs_dir=str(tmp_path),
                           progress=False).frame()
    assert (frame.status == "ok").all(), frame[frame.status != "ok"][["variant", "metric", "message"]]

    def row(variant, metric):
        return frame[(frame.variant == variant) & (frame.metric == metric)].iloc[0]

    for variant in exp.VARIANTS:
        for metric in ("padding_fraction", "document_tokens", "attention_pairs"):
            r = row(variant, metric)
            if variant != "packed" or metric != "padding_fraction":  # first-fit may need a row more
                assert r.value == pytest.approx(r.predicted), (variant, metric)
        assert row(variant, "useful_tokens_per_s").value > 0
    assert row("packed", "documents_isolated").value == 1 and row("packed_naive", "documents_isolated").value == 0
    assert "attended to each other" in row("packed_naive", "step_ms").message
    assert row("packed", "grad_rel_diff").value <= exp.TOLERANCE
    assert row("packed_naive", "document_loss_max_rel_diff").value > exp.TOLERANCE
    assert row("packed", "padding_fraction").value < row("padded", "padding_fraction").value
    assert row("packed", "peak_mem_bytes").value == pytest.approx(row("packed", "peak_mem_bytes").predicted, rel=0.1)


def test_the_quiz_questions_state_labkits_figures():
    from labkit.study.quiz import load_bank

    bank = {q.id: q for q in load_bank() if q.id.startswith("packing-")}
    assert sorted(bank) == [f"packing-0{i}" for i in range(1, 7)]  # packing-06: test_packing_recipe.py
    text = {k: q.question + q.explanation + "".join(q.choices) + "".join(q.feedback) for k, q in bank.items()}
    # packing-01: lengths 100, 20, 20, 20 padded to 100 -> 1 - 160 / 400
    assert f"{packing.padding_fraction([100, 20, 20, 20], 4, 100):.0%}" in text["packing-01"]
    # packing-02: the same four packed into rows of 128 -> 2 rows
    rows = len(packing.first_fit([100, 20, 20, 20], 128))
    assert f"{packing.padding_fraction([100, 20, 20, 20], rows, 128):.1%}" in text["packing-02"]
    # packing-04: four documents of 256 in a row of 1024: pairs needed against the causal row
    need, row_pairs = packing.document_pairs([256] * 4), packing.causal_pairs(1024)
    assert f"{need:,}" in text["packing-04"] and f"{row_pairs:,}" in text["packing-04"]
    assert f"{need / row_pairs:.3f}" in text["packing-04"]
