"""The fine-tuning exercises (labkit.study.exercises.finetune), graded from outside.

For "cpu" and a simulated "cuda": the answer a careful learner derives from the scenario and the
details (closed forms written here from the model's shapes, never from the planner) is graded
right, and the common mistake (and the other usual wrong answers) is graded wrong. One real
measurement of the exercises' Run (the finetune experiment at small sizes) then shows the
mechanisms, `supports` returns None on it, and doctored rows are not taken as support."""
import copy

import pytest

from conftest import needs

from labkit.study.exercises import RUNS, Rows, Setup, grade
from labkit.study.exercises import finetune as ft
from labkit.study.exercises.core import measure_setup

pytestmark = needs("peft", "torchao")

RUN = RUNS["finetune"]
DEVICES = ("cpu", "cuda")
EXERCISES = {ex.key: ex for ex in ft.build_exercises()}


def setup(device="cpu"):
    return Setup(RUN, device)


def shapes(s):
    """The numbers the details state, as plain names."""
    m, c = s.cfg("lora").model, s.cfg("lora")
    assert m.arch == "llama" and not m.tie_embeddings  # the closed forms below assume both
    q, kv, d, f = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.hidden_size, m.ffn_size
    linears = {"q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q), "gate": (f, d), "up": (f, d),
               "down": (d, f)}
    spec = c.lora_targets  # a comma list as given, or the tuple it resolves to
    targets = list(spec) if isinstance(spec, (tuple, list)) else [t.strip() for t in spec.split(",")]
    return dict(L=m.num_layers, d=d, V=m.vocab_size, linears=linears, r=c.lora_rank, targets=targets)


def psi(x):
    """Embedding + untied head + per block (its seven linears and two RMSNorms) + final norm."""
    block = sum(o * i for o, i in x["linears"].values()) + 2 * x["d"]
    return 2 * x["V"] * x["d"] + x["L"] * block + x["d"]


def lora_params(x, *, square=False, r_squared=False):
    per_layer = 0
    for t in x["targets"]:
        o, i = x["linears"][t]
        per_layer += x["r"] ** 2 if r_squared else x["r"] * (2 * x["d"] if square else o + i)
    return x["L"] * per_layer


def nf4_weight_bytes(o, i, *, double_quant=True):
    """torchao's NF4Tensor from an fp32 weight, as the details state it: the codes, the int8
    scalers, an fp32 factor per scaler block, the fp32 mean and the 16-entry fp32 code book."""
    numel = o * i
    blocks = numel // 64
    if not double_quant:
        return numel // 2 + 4 * blocks
    group = next(g for g in (256, 128, 64, 32, 16, 8, 4, 2, 1) if blocks % g == 0)
    assert blocks > group, "one scaler block: torchao keeps a longer factor tensor (not stated)"
    return numel // 2 + blocks + 4 * (blocks // group) + 4 + 16 * 4


def nf4_base(x, **kw):
    return x["L"] * sum(nf4_weight_bytes(o, i, **kw) for o, i in x["linears"].values())


LEARNER = {
    "lora_trainable_params": lambda x: lora_params(x),
    "lora_optimizer_saving": lambda x: 8 * (psi(x) - lora_params(x)),
    "qlora_base_bytes": nf4_base,
    "int8_base_bytes": lambda x: x["L"] * sum(o * i + 2 * o for o, i in x["linears"].values()),
    "lora_long_context": lambda x: ft.ACTS,
}
MISTAKE = {
    "lora_trainable_params": lambda x: lora_params(x, square=True),
    "lora_optimizer_saving": lambda x: 16 * (psi(x) - lora_params(x)),
    "qlora_base_bytes": lambda x: x["L"] * sum(o * i // 2 for o, i in x["linears"].values()),
    "int8_base_bytes": lambda x: x["L"] * sum(o * i for o, i in x["linears"].values()),
    "lora_long_context": lambda x: ft.FROZEN_STATES,
}
# Other wrong answers the tolerance must reject too.
ALSO_WRONG = {
    "lora_trainable_params": [lambda x: lora_params(x, r_squared=True)],
    "lora_optimizer_saving": [lambda x: 8 * psi(x), lambda x: 12 * (psi(x) - lora_params(x))],
    "qlora_base_bytes": [lambda x: nf4_base(x, double_quant=False)],
    # an fp32 scale per row; a 16-bit scale per 64 weights (int4's grouping)
    "int8_base_bytes": [lambda x: x["L"] * sum(o * i + 4 * o for o, i in x["linears"].values()),
                        lambda x: x["L"] * sum(o * i + 2 * o * i // 64 for o, i in x["linears"].values())],
    "lora_long_context": [lambda x: ft.WEIGHTS, lambda x: ft.ADAPTER_STATES],
}


def test_every_exercise_is_covered_and_complete():
    assert set(EXERCISES) == set(LEARNER) == set(MISTAKE)
    for ex in EXERCISES.values():
        assert ex.run == "finetune" and ex.hint and ex.mistake_why and ex.supports is not None
        assert ex.graded_against == "formula" and (ex.choices or ex.unit)
    assert set(EXERCISES["lora_long_context"].feedback) == set(EXERCISES["lora_long_context"].choices)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key", list(LEARNER))
def test_the_careful_learner_is_graded_right_and_the_mistakes_wrong(key, device):
    ex, s = EXERCISES[key], setup(device)
    x = shapes(s)
    with s.formulas():
        reference, mistake = ex.answer(s), ex.mistake(s)
    learner = LEARNER[key](x)
    assert grade(ex, learner, reference), (learner, reference)
    if not ex.choices:
        assert learner == pytest.approx(reference, rel=1e-12), "the why's method must reproduce it"
    assert mistake == MISTAKE[key](x) and ex.is_mistake(mistake, s)
    for wrong in [MISTAKE[key]] + ALSO_WRONG[key]:
        assert not grade(ex, wrong(x), reference), wrong(x)


def test_the_tiny_numbers_meet_the_issues_goals():
    """LoRA trains under 5% of the parameters; the NF4 linears are under 0.145x their fp32 bytes."""
    x = shapes(setup())
    assert lora_params(x) <= 0.05 * psi(x)
    fp32 = 4 * x["L"] * sum(o * i for o, i in x["linears"].values())
    assert nf4_base(x) <= 0.145 * fp32
    # the ffn's block count does not divide by 256: the scaler group must follow the rule
    o, i = x["linears"]["gate"]
    assert (o * i // 64) % 256 and ft.planner.nf4_scaler_block(o * i, 64) == 64


def test_the_details_print_the_numbers_the_learner_uses():
    s = setup()
    x = shapes(s)
    for key in ("lora_trainable_params", "lora_optimizer_saving", "qlora_base_bytes"):
        text = EXERCISES[key].details(s)
        assert all(f"{name} {o} x {i}" in text for name, (o, i) in x["linears"].items()), key
        assert f"r = {x['r']}" in text or key == "qlora_base_bytes"
        assert f"{psi(x):,} parameters" in text
    nf4 = EXERCISES["qlora_base_bytes"].details(s)
    assert "scaler block 256" in nf4 and "scaler block 64" in nf4 and "fp32" in nf4


@pytest.fixture(scope="module")
def rows(shared_runs):
    """The Run's one real measurement on the CPU, with every exercise's (conftest)."""
    return measure_setup(setup("cpu"), shared_runs)


def test_the_measurement_supports_every_answer(rows):
    s = setup()
    for key, ex in EXERCISES.items():
        assert ex.supports(rows, s) is None, (key, ex.supports(rows, s))
        assert ex.why.format(**ex.evidence(rows, s), answer="a", prediction="p")
    x = shapes(s)
    assert rows.get("lora", "trainable_params") == lora_params(x)
    assert rows.get("qlora", "linear_weight_bytes") == nf4_base(x)


def doctored(rows, variant, metric, factor):
    changed = copy.deepcopy(rows.rows)
    for r in changed:
        if r["variant"] == variant and r["metric"] == metric:
            r["value"] = r["value"] * factor
    return Rows(changed, "doctored")


@pytest.mark.parametrize("key,variant,metric,factor", [
    ("lora_trainable_params", "lora", "trainable_params", 2),
    ("lora_optimizer_saving", "lora", "optimizer_bytes", 2),
    ("lora_optimizer_saving", "full", "optimizer_bytes", 0.5),
    ("qlora_base_bytes", "qlora", "linear_weight_bytes", 8),
    ("lora_long_context", "lora", "activation_bytes", 0.01),
])
def test_doctored_rows_are_not_taken_as_support(rows, key, variant, metric, factor):
    message = EXERCISES[key].supports(doctored(rows, variant, metric, factor), setup())
    assert isinstance(message, str) and message
