"""The log line's interval: a non-finite step's loss is left out of the sum, rates are over the
interval's own time, and a checkpoint round-trip keeps it."""

import math

import torch

from aamperf.metrics.interval import Interval

CPU = torch.device("cpu")


def test_rates_and_the_bad_steps_loss_left_out():
    interval = Interval(CPU)
    interval.add(0.5, 0.1, 8, 800, torch.tensor(2.0), torch.tensor(False))
    interval.add(1.5, 0.3, 8, 800, torch.tensor(math.inf), torch.tensor(True))
    assert interval.loss_sum.item() == 2.0  # the inf of the skipped step is not in it
    assert interval.steps == 2
    assert interval.rates() == {
        "step_time_s": 1.0,
        "samples_per_s": 8.0,
        "tokens_per_s": 800.0,
        "data_wait_frac": 0.2,
    }
    interval.reset()
    assert (interval.steps, interval.samples, interval.loss_sum.item()) == (0, 0, 0.0)


def test_state_round_trip():
    interval = Interval(CPU)
    interval.add(0.25, 0.0, 4, 40, torch.tensor(1.5), torch.tensor(False))
    again = Interval(CPU)
    again.load_state_dict(interval.state_dict())
    assert again.state_dict() == {**interval.state_dict(), "loss_sum": again.loss_sum}
    assert again.loss_sum.item() == 1.5 and again.rates() == interval.rates()
