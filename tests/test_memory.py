import matplotlib
import pytest
import torch
from torch import nn

from course_utils.dataparallel.by_hand import data_parallel
from course_utils.dataparallel.memory import (
    CATEGORIES,
    Ledger,
    ModelSpec,
    ledger,
    live_bytes_by_op,
    plot_ledgers,
    saved_tensor_bytes,
)
from course_utils.dataparallel.simulated import record_memory, sim_devices
from course_utils.models import BertLike

matplotlib.use("Agg")
LINEAR = ModelSpec.linear(5, 2)  # 12 parameters = 48 bytes in fp32


def test_linear_dp_by_hand():
    led = ledger(LINEAR, "dp", batch_size=30, num_devices=4, optimizer="adam")
    assert led.rows_per_device == [8, 8, 8, 6]
    d0, d1, d3 = led.rows[0], led.rows[1], led.rows[3]
    assert d0["parameters"] == d1["parameters"] == 48
    assert d0["optimizer state"] == 96 and d1["optimizer state"] == 0
    assert d0["inputs"] == 30 * 5 * 4 and d1["inputs"] == 8 * 5 * 4 and d3["inputs"] == 6 * 5 * 4
    assert d0["outputs"] == d0["output gradient"] == d0["targets"] == 30 * 2 * 4
    assert d1["outputs"] == d1["targets"] == 0
    assert d0["loss"] == 4 and d1["loss"] == 0  # MSE saves nothing new; the scalar loss
    assert led.difference(0, 1) == {**dict.fromkeys(CATEGORIES, 0), "optimizer state": 96,
                                     "inputs": 600 - 160, "outputs": 240, "output gradient": 240,
                                     "targets": 240, "loss": 4}
    # the totals differ by exactly those bytes: 96 + (600 - 160) + 3 x 240 + 4
    assert led.total(0) - led.total(1) == 1260


def test_output_device_moves_the_outputs_but_not_the_model_state():
    led = ledger(LINEAR, "dp", batch_size=30, num_devices=4, output_device=2)
    assert led.rows[2]["outputs"] == 240 and led.rows[0]["outputs"] == 0
    assert led.rows[0]["optimizer state"] == 96 and led.rows[2]["optimizer state"] == 0
    assert "output_device=2" in led.label


def test_parallel_criterion_keeps_outputs_on_their_devices():
    led = ledger(LINEAR, "parallel_criterion", batch_size=30, num_devices=4, optimizer="sgd")
    assert [r["outputs"] for r in led.rows] == [64, 64, 64, 48]
    assert [r["targets"] for r in led.rows] == [240, 64, 64, 48]
    assert led.rows[0]["loss"] == 8 and led.rows[1]["loss"] == 4  # own part + the reduced loss


def test_ddp_is_balanced_and_pays_for_buckets():
    spec = ModelSpec.bert_like(vocab=100, hidden=16, layers=2, heads=2, intermediate=32, seq_len=8)
    led = ledger(spec, "ddp", batch_size=32, num_devices=4)
    assert len({led.total(d) for d in range(4)}) == 1
    assert led.rows[3]["DDP buckets"] == led.rows[3]["parameters"] == spec.parameters * 4
    with pytest.raises(ValueError, match="not a multiple of num_devices"):
        ledger(spec, "ddp", batch_size=30, num_devices=4)


def test_half_precision_halves_the_floats_only():
    full = ledger(LINEAR, "dp", batch_size=8, num_devices=2)
    half = ledger(LINEAR, "dp", batch_size=8, num_devices=2, dtype=torch.float16)
    assert half.rows[0]["parameters"] * 2 == full.rows[0]["parameters"]
    assert half.rows[0]["outputs"] * 2 == full.rows[0]["outputs"]
    assert half.rows[0]["inputs"] == full.rows[0]["inputs"]  # the ledger's inputs keep their dtype


def test_idle_devices_hold_nothing():
    led = ledger(LINEAR, "dp", batch_size=10, num_devices=8)
    assert led.rows_per_device == [2, 2, 2, 2, 2, 0, 0, 0]
    assert led.total(7) == 0 and led.total(4) > 0


@pytest.mark.parametrize("kwargs, error, message", [
    ({"strategy": "fsdp"}, ValueError, "strategy must be one of"),
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"batch_size": 2.5}, TypeError, "batch_size"),
    ({"num_devices": 0}, ValueError, "num_devices"),
    ({"output_device": 4}, ValueError, "output_device must be in 0..3"),
    ({"strategy": "ddp", "output_device": 1}, ValueError, "applies to strategy='dp' only"),
    ({"dtype": torch.int64}, TypeError, "floating torch.dtype"),
    ({"optimizer": "lamb"}, ValueError, "optimizer must be one of"),
])
def test_bad_arguments(kwargs, error, message):
    args = {"strategy": "dp", "batch_size": 32, "num_devices": 4, **kwargs}
    with pytest.raises(error, match=message):
        ledger(LINEAR, args.pop("strategy"), **args)
    with pytest.raises(TypeError, match="spec must be a ModelSpec"):
        ledger("bert", "dp", batch_size=32, num_devices=4)


@pytest.mark.parametrize("config", [(1000, 32, 2, 64, 16), (50, 8, 1, 16, 4), (7, 12, 3, 20, 9)])
def test_bert_parameter_count_is_exact(config):
    vocab, hidden, layers, intermediate, max_len = config
    model = BertLike(vocab, hidden, layers, 4, intermediate, max_len)
    assert sum(p.numel() for p in model.parameters()) == BertLike.count_parameters(*config)


def test_bert_activations_extrapolate_exactly_to_more_layers():
    spec = ModelSpec.bert_like(vocab=64, hidden=16, layers=3, heads=2, intermediate=32, seq_len=8)
    torch.manual_seed(0)
    model = BertLike(64, 16, 3, 2, 32, 8)
    ids = torch.randint(0, 64, (2, 8))
    floats, other = saved_tensor_bytes(lambda: model(ids), exclude=list(model.parameters()) + [ids])
    assert spec.activation_floats * 4 * 2 == floats
    assert spec.activation_other_bytes * 2 == other


def test_from_module_agrees_with_the_linear_spec():
    measured = ModelSpec.from_module("lin", nn.Linear(5, 2), torch.randn(4, 5), torch.randn(4, 2),
                                     nn.functional.mse_loss)
    for field in ("parameters", "activation_floats", "inputs", "outputs", "targets",
                  "loss_saved_floats"):
        assert getattr(measured, field) == getattr(LINEAR, field), field
    ce = ModelSpec.from_module("clf", nn.Linear(5, 7), torch.randn(4, 5), torch.randint(0, 7, (4,)),
                               nn.functional.cross_entropy)
    assert ce.loss_saved_floats == 7  # cross-entropy keeps the log-probabilities
    with pytest.raises(ValueError, match="same number of rows"):
        ModelSpec.from_module("x", nn.Linear(5, 2), torch.randn(4, 5), torch.randn(3, 2),
                              nn.functional.mse_loss)


@pytest.mark.parametrize("batch, devices", [(10, 3), (30, 4), (9, 8)])
def test_ledger_matches_what_the_emulation_creates(batch, devices):
    torch.manual_seed(0)
    model = BertLike(50, 8, 1, 2, 16, 6)
    spec = ModelSpec.bert_like(vocab=50, hidden=8, layers=1, heads=2, intermediate=16, seq_len=6)
    ids = torch.randint(0, 50, (batch, 6))
    with record_memory() as record:
        out = data_parallel(model, ids, sim_devices(devices), strict=False)
        out.sum().backward()
    led = ledger(spec, "dp", batch_size=batch, num_devices=devices)
    for d in range(devices):
        name = f"sim:{d}"
        assert record.bytes(name, "inputs") == led.rows[d]["inputs"], (d, "inputs")
        assert record.bytes(name, "parameters") == led.rows[d]["parameters"], (d, "parameters")
        assert record.bytes(name, "outputs") == led.rows[d]["outputs"], (d, "outputs")
    grads = sum(p.grad.nbytes for p in model.parameters())
    assert grads == led.rows[0]["gradients"]


def test_plot_ledgers_draws_stacked_bars():
    leds = [ledger(LINEAR, s, batch_size=32, num_devices=4) for s in ("dp", "ddp")]
    axes = plot_ledgers(leds, unit=1, unit_name="bytes")
    assert len(axes) == 2
    assert len(axes[0].patches) % 4 == 0 and len(axes[0].patches) > 0
    with pytest.raises(ValueError, match="empty"):
        plot_ledgers([])
    assert isinstance(leds[0], Ledger)
    matplotlib.pyplot.close("all")


def test_cross_entropy_backward_holds_four_logits_for_a_moment():
    """The ledger's three logits-sized tensors (outputs, their gradient, the log-probabilities) are
    what backward starts from; log-softmax's backward adds a fourth while it runs (notebook 04)."""
    torch.manual_seed(0)
    head = nn.Linear(4, 3000)
    features, targets = torch.randn(16, 4), torch.randint(0, 3000, (16,))
    logits_bytes = 16 * 3000 * 4

    def step():
        logits = head(features)
        nn.functional.cross_entropy(logits, targets).backward()

    steps = live_bytes_by_op(step, exclude=[*head.parameters(), features, targets])
    live = dict(steps)  # the last value of each operation's name
    assert round(live["nll_loss_forward"] / logits_bytes, 3) == 2  # logits, log-probabilities
    op, peak = max(steps, key=lambda s: s[1])
    assert op == "_log_softmax_backward_data" and round(peak / logits_bytes, 3) == 4
    spec = ModelSpec.from_module("head", head, features, targets, nn.functional.cross_entropy)
    led = ledger(spec, "dp", batch_size=16, num_devices=2, optimizer="sgd")
    assert sum(led.rows[0][c] for c in ("outputs", "output gradient", "loss")) - 4 == 3 * logits_bytes


def test_live_bytes_counts_a_storage_once_and_frees_it():
    def fn():
        x = torch.ones(1000)
        y = x.view(10, 100)  # a view: the same storage
        del x, y
        torch.zeros(10)

    steps = live_bytes_by_op(fn)
    assert [n for _, n in steps] == [4000, 4000, 40]
    with pytest.raises(TypeError, match="function of no arguments"):
        live_bytes_by_op(3)
