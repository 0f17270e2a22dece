"""Mixture of experts (labkit.blocks.moe, labkit.planner.moe) and expert parallelism on two gloo
ranks (labkit.techniques.moe), against one process and hand computations.

One launch of the experiment serves every test that reads rows: the clean run, then the same
with expert outputs combined without their router weights, and with rows sent to the wrong rank."""
import json
import math

import pytest
import torch

from conftest import TINY_DIST, launch_fixtures
from conftest import one_row as get
from labkit import cli, planner
from labkit.blocks import moe
from labkit.blocks.losses import lm_loss
from labkit.blocks.training import Trainer
from labkit.config import ConfigError, ModelConfig, RunConfig, resolve
from labkit.techniques import moe as moe_exp

RANKS = (0, 1)
CPU = {**TINY_DIST, "timed_steps": 1, "device": "cpu", "nproc": 2}
POINTS = [{"moe_fault": f} for f in moe.FAULTS]  # none first


run, rows = launch_fixtures("moe", CPU, POINTS, {"moe_fault": "none"})



# --- two ranks, one launch -------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_expert_parallel_equals_one_process(rows):
    for rank in RANKS:
        assert {r["status"] for r in rows if r["rank"] == rank} == {"ok"}
        for metric in ("grad_max_rel_diff", "logits_max_abs_diff", "loss_abs_diff"):
            assert get(rows, "ep", metric, rank)["value"] <= moe_exp.TOLERANCE, metric
    # the same routing: the same drops and the same aux loss, rank by rank
    for metric in ("dropped_fraction", "aux_loss", "load_imbalance"):
        for rank in RANKS:
            assert get(rows, "ep", metric, rank)["value"] == pytest.approx(
                get(rows, "single", metric, rank)["value"], rel=1e-6), metric


@pytest.mark.multiprocess
def test_bytes_and_counts_equal_the_formulas(rows):
    layers = get(rows, "ep", "loss", 0)["params"]["model"]["num_layers"]
    for rank in RANKS:
        for metric in ("all_to_all_bytes", "comm_bytes", "param_bytes", "expert_param_bytes",
                       "grad_bytes", "dropped_fraction", "capacity_tokens"):
            row = get(rows, "ep", metric, rank)
            assert row["value"] == row["predicted"], (metric, rank)
        assert get(rows, "ep", "all_to_all_count", rank)["value"] == 5 * layers
        assert get(rows, "ep", "all_reduce_count", rank)["value"] == 1
        assert get(rows, "ep", "aux_loss", rank)["value"] == pytest.approx(
            get(rows, "ep", "aux_loss", rank)["predicted"], rel=1e-6)
        # half the experts on each rank; the reference sends nothing
        assert get(rows, "ep", "expert_param_bytes", rank)["value"] * 2 == \
            get(rows, "single", "expert_param_bytes", rank)["value"]
        assert get(rows, "single", "comm_bytes", rank)["value"] == 0
        sent = get(rows, "ep", "offrank_bytes", rank)["value"]
        assert 0 < sent < get(rows, "ep", "all_to_all_bytes", rank)["value"]


@pytest.mark.multiprocess
def test_the_check_catches_unweighted_combine_and_wrong_rank(run):
    for fault in ("unweighted_combine", "wrong_rank"):
        for rank in RANKS:
            mine = [r for r in run if r["params"]["moe_fault"] == fault and r["rank"] == rank]
            assert {r["status"] for r in mine if r["variant"] == "single"} == {"ok"}
            ep = [r for r in mine if r["variant"] == "ep"]
            assert ep and {r["status"] for r in ep} == {"error"}, fault
            assert all(r["message"].startswith("does not match single") for r in ep)


@pytest.mark.multiprocess
def test_the_figures_draw_from_the_rows(rows):
    import pandas as pd

    from labkit.views import moe as views

    frame = pd.DataFrame(rows)
    drops = views.drops_figure(frame)
    assert [t.name for t in drops.data][:2] == ["measured", "predicted from the loads"]
    assert list(drops.data[0].y) == list(drops.data[1].y)  # exact from the loads
    traffic = views.bytes_figure(frame)
    assert len(traffic.data) == 4 and list(traffic.data[0].y) == list(traffic.data[1].y)


# --- routing, capacity and the loss by hand ---------------------------------------------------------

EXPERTS = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])  # 4 tokens, top-2 of 3 experts


def test_capacity_drops_exactly_the_late_assignments():
    # C = ceil(0.75 x 4 x 2 / 3) = 2. Queues, first choices before second ones: expert 0 takes
    # t0, t1 and refuses t2 and t3's second; expert 1 takes t3, t0's second, refuses t2's second.
    cap = planner.capacity(4, 2, 3, 0.75)
    assert cap == 2
    kept = moe.kept_mask(EXPERTS, 3, cap)
    assert kept.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    loads = torch.bincount(EXPERTS.flatten(), minlength=3).tolist()
    assert loads == [4, 3, 1] and planner.dropped_assignments(loads, cap) == 3 == int((~kept).sum())
    # two groups of 2 tokens: C = 1 per group
    assert moe.kept_mask(EXPERTS, 3, planner.capacity(2, 2, 3, 0.75), groups=2).tolist() == \
        [[True, True], [False, True], [True, False], [True, False]]
    assert moe.kept_mask(EXPERTS, 3, 0).all()  # capacity_factor 0: no limit


def test_a_token_dropped_everywhere_keeps_only_its_residual():
    cfg = ModelConfig(hidden_size=8, num_experts=3, moe_ffn_size=4, capacity_factor=0.75)
    layer = moe.MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    weights = torch.tensor([[0.6, 0.4]]).expand(4, 2)
    routing = moe.Routing(EXPERTS, weights, moe.kept_mask(EXPERTS, 3, 2), torch.full((4, 3), 1 / 3), 2)
    x = torch.randn(4, 8)
    out = moe.local_dispatch(layer, x, routing)
    assert torch.equal(out[2], torch.zeros(8))  # both assignments dropped
    ex = layer.experts
    alone = ex.w2[1] @ (torch.nn.functional.silu(ex.w1[1] @ x[3]) * (ex.w3[1] @ x[3]))
    torch.testing.assert_close(out[3], 0.6 * alone)  # its second choice dropped, not renormalised


def test_aux_loss_is_the_hand_computation():
    # probabilities t0 = (0.5, 0.3, 0.2), t1 = (0.1, 0.6, 0.3); top-2: {0, 1} and {1, 2}
    logits = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]).log()
    routing = moe.route(logits, 2, factor=0.0)
    assert routing.experts.tolist() == [[0, 1], [1, 2]]
    torch.testing.assert_close(routing.weights, torch.tensor([[0.625, 0.375], [2 / 3, 1 / 3]]))
    # f = (1/2, 2/2, 1/2), P = (0.3, 0.45, 0.25): 3 x (0.15 + 0.45 + 0.125)
    assert moe.aux_loss(routing, 3).item() == pytest.approx(2.175, rel=1e-6)
    assert planner.load_balancing_loss([1, 2, 1], [0.3, 0.45, 0.25], 2) == pytest.approx(2.175)
    unnormalised = moe.route(logits, 2, factor=0.0, norm=False)  # Qwen2-MoE's default
    torch.testing.assert_close(unnormalised.weights, torch.tensor([[0.5, 0.3], [0.6, 0.3]]))


def test_uniform_routing_drops_by_hand():
    # 2 tokens, top-1 of 2, C = 1: of 4 equally likely routings two put both on one expert
    assert planner.uniform_drop_fraction(2, 1, 2, 0.5) == pytest.approx(0.25)
    assert planner.uniform_drop_fraction(128, 2, 4, 0.0) == 0.0


def test_training_loss_adds_the_load_balancing_loss():
    cfg = resolve(RunConfig, "tiny", {"device": "cpu", "num_layers": 1, "batch_size": 1, "seq_len": 8,
                                      "num_experts": 4, "moe_ffn_size": 32, "router_aux_loss_coef": 0.5})
    trainer = Trainer(cfg, optimizer=False)
    loss = trainer.forward()
    plain = lm_loss(trainer.model(trainer.inputs), trainer.targets)
    aux = trainer.model.layers[0].mlp.aux
    assert loss.item() == pytest.approx(plain.item() + 0.5 * aux.item(), rel=1e-6)


# --- the planner: Mixtral-8x7B ------------------------------------------------------------------------

def test_mixtral_8x7b_plan_counts_total_active_and_ep8(tmp_path, capsys):
    config = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 32000, "max_position_embeddings": 32768, "num_local_experts": 8,
              "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
              "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["plan", "--hf-model", str(tmp_path), "--ep", "8", "--gpus", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    d, f, L = 4096, 14336, 32
    attention = 2 * d * d + 2 * d * 1024  # q, o; k, v (8 kv heads of 128)
    expert, rest = 3 * d * f, 2 * 32000 * d + d  # embedding, head, final norm
    layer = attention + 8 * d + 2 * d  # + router, two norms
    assert report["num_params"] == L * (layer + 8 * expert) + rest == 46_702_792_704
    assert report["moe"]["active_params"] == L * (layer + 2 * expert) + rest == 12_879_925_248
    rank = report["moe"]["per_rank"]  # one expert per layer on each of 8 ranks
    assert rank["expert_params"] == L * expert == 5_637_144_576
    assert rank["replicated_params"] == L * layer + rest == 1_605_636_096
    assert rank["param_bytes"] == 2 * 7_242_780_672  # bf16_weights: 16-bit weights
    assert rank["model_states_bytes"] == 16 * 7_242_780_672  # 2 + 2 + 12 bytes a parameter
    assert cli.main(["plan", "--hf-model", str(tmp_path), "--ep", "8"]) == 0
    assert "12,879,925,248 active parameters per token" in capsys.readouterr().out


def test_refusals_are_one_line():
    with pytest.raises(ConfigError, match="experts_per_token=5 is more than num_experts=4"):
        resolve(RunConfig, "tiny", {"device": "cpu", "num_experts": 4, "experts_per_token": 5})
    with pytest.raises(ConfigError, match="Llama-style"):
        resolve(RunConfig, "gpt2-124m", {"device": "cpu", "num_experts": 4})
    with pytest.raises(ConfigError, match="expert parallelism"):
        planner.local_shape(planner.MIXTRAL_8X7B, tp=2)
    with pytest.raises(ConfigError, match="does not divide num_experts=8"):
        planner.ep_rank_params(planner.MIXTRAL_8X7B, 3)
    with pytest.raises(ConfigError, match="ep=2: expert parallelism needs"):
        planner.plan_report(model="tiny", ep=2)
    with pytest.raises(ConfigError, match="does not split over 2 ranks"):
        moe_exp.validate(resolve(moe_exp.Config, "tiny", {"device": "cpu", "num_experts": 3, "nproc": 2},
                                 experiment="moe"))
    assert math.isclose(planner.uniform_max_load_ratio(128, 2, 4), 1.0909, rel_tol=1e-3)
