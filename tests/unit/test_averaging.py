"""--ema's average (parallel/averaging.py) on one process: the update, the swap, the state."""

import torch

from ddptrain.parallel.averaging import WeightAverage


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    model[1].bias.requires_grad_(False)  # frozen: never averaged
    return model


def _step(model: torch.nn.Module, scale: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale)


def test_every_update_is_decay_times_the_average_plus_the_rest_times_the_weights():
    model = _model()
    average = WeightAverage(model, decay=0.9)
    expected = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert set(average.state_dict()) == set(expected) == {"0.weight", "0.bias", "1.weight"}
    for step in range(1, 4):
        _step(model, 0.5 * step)
        average.update(step)
        for name, param in model.named_parameters():
            if name in expected:
                expected[name] = 0.9 * expected[name] + 0.1 * param.detach()
    for name, value in average.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7)


def test_ema_every_n_steps_updates_on_their_multiples_only():
    model = _model()
    average = WeightAverage(model, decay=0.5, every=2)
    start = {k: v.clone() for k, v in average.state_dict().items()}
    _step(model, 1.0)
    average.update(1)
    assert all(torch.equal(start[k], v) for k, v in average.state_dict().items())
    average.update(2)
    assert not any(torch.equal(start[k], v) for k, v in average.state_dict().items())


def test_swapped_in_puts_the_average_in_the_parameters_and_everything_back_bitwise():
    model = _model()
    average = WeightAverage(model, decay=0.9)
    _step(model, 1.0)
    average.update(1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    kept = {k: v.clone() for k, v in average.state_dict().items()}
    settled = []
    with average.swapped_in(lambda: settled.append(True)):
        for name, param in model.named_parameters():
            expected = kept.get(name, weights[name])  # the frozen bias stays as it is
            assert torch.equal(param, expected), name
    assert settled == [True, True]  # before the swap and before the swap back
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, kept[k]) for k, v in average.state_dict().items())


def test_state_round_trips_and_a_snapshot_without_one_starts_at_the_loaded_weights():
    model = _model()
    average = WeightAverage(model, decay=0.9)
    _step(model, 1.0)
    average.update(1)
    saved = {k: v.clone() for k, v in average.state_dict().items()}
    other = WeightAverage(_model(), decay=0.9)
    other.load_state_dict(saved, whole=True)
    assert all(torch.equal(saved[k], v) for k, v in other.state_dict().items())
    other.load_state_dict(None, whole=True)  # resumed from a run without --ema
    assert all(torch.equal(v, dict(other.params)[k].detach()) for k, v in other.state_dict().items())


def test_the_average_is_keyed_as_the_model_s_state_with_activation_checkpointing_or_without():
    """--activation-checkpointing wraps each block (torch's checkpoint_wrapper), which renames its
    parameters; the model's state dict leaves the wrapper's name out, and so must the average's,
    or a run saved with it would not resume without it (found: DCP's "Missing key ... ema.")."""
    from ddptrain.parallel.base import checkpoint_blocks

    plain, wrapped = _model(), _model()
    checkpoint_blocks(wrapped, [wrapped[0]])
    assert any("_checkpoint_wrapped_module" in name for name, _ in wrapped.named_parameters())
    keys = set(WeightAverage(wrapped, decay=0.9).state_dict())
    assert keys == set(WeightAverage(plain, decay=0.9).state_dict()) == {"0.weight", "0.bias", "1.weight"}
    assert keys <= set(wrapped.state_dict())
