"""The shared training loop learns, reports progress, and is reproducible."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from attn_course.training import accuracy, fit, iterate_batches, predict


def _toy_problem():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 2, generator=gen)
    y = (x[:, 0] * x[:, 1] > 0).long()  # XOR-like: needs the hidden layer
    return x, y


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 2))


def test_fit_learns_and_records_history():
    x, y = _toy_problem()
    model = _model()
    before = accuracy(model, x, y)
    history = fit(model, x, y, epochs=30, batch_size=64, lr=1e-2, eval_data=(x, y), progress=False)
    assert len(history.train_loss) == 30 and len(history.eval_accuracy) == 30
    assert history.train_loss[-1] < history.train_loss[0] * 0.5
    assert history.eval_accuracy[-1] > 0.9 > before
    assert history.seconds > 0


def test_fit_is_reproducible():
    x, y = _toy_problem()
    a, b = _model(), _model()
    fit(a, x, y, epochs=2, progress=False)
    fit(b, x, y, epochs=2, progress=False)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_iterate_batches_covers_everything_once():
    x, y = torch.arange(10).float(), torch.arange(10)
    seen = torch.cat([b for _, b in iterate_batches(x, y, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1))])
    assert sorted(seen.tolist()) == list(range(10))
    with pytest.raises(ValueError, match="same length"):
        list(iterate_batches(x, y[:5], batch_size=2))


def test_fit_ends_with_a_summary_line_that_a_saved_notebook_can_show(capsys):
    x, y = _toy_problem()
    history = fit(_model(), x, y, epochs=2, batch_size=128, eval_data=(x, y), description="toy")
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == (
        f"toy: 2 epochs (8 steps), final training loss {history.train_loss[-1]:.3g}, "
        f"eval accuracy {history.eval_accuracy[-1]:.3f}"
    )
    fit(_model(), x, y, epochs=1, progress=False)
    assert capsys.readouterr().out == ""


def test_fit_refreshes_its_bar_at_most_once_a_second(monkeypatch):
    # A notebook bar sends one message per refresh, read by nbval only after the cell: lesson 09's
    # 80-epoch training under load sent enough (tqdm's default, 10 refreshes a second) for ZMQ to drop
    # the kernel's "idle" and fail the run. Each step here sleeps 8 ms, so the 320 steps last at least
    # 2.5 s on any machine and tqdm's default would refresh 25 times or more; the end of each of the 5
    # epochs refreshes too (the postfix).
    import functools
    import io
    import time

    import attn_course.training as training

    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x):
            time.sleep(0.008)
            return self.linear(x)

    out = io.StringIO()
    monkeypatch.setattr(training, "tqdm", functools.partial(training.tqdm, file=out))
    x, y = _toy_problem()
    history = fit(Slow(), x, y, epochs=5, batch_size=8, progress=True)  # 5 x 64 steps
    refreshes = out.getvalue().count("\r")
    assert history.seconds >= 2.5
    assert refreshes <= history.seconds + 5 + 3, (refreshes, history.seconds)


def test_fit_augments_every_training_batch_with_its_own_generator():
    inputs, targets = _toy_problem()
    seen = []

    def augment(batch, generator):
        assert isinstance(generator, torch.Generator)
        seen.append(batch.shape[0])
        return batch + 0.01 * torch.randn(batch.shape, generator=generator)

    torch.manual_seed(0)
    model = _model()
    fit(model, inputs, targets, epochs=2, batch_size=16, augment=augment, progress=False)
    assert sum(seen) == 2 * inputs.shape[0], "every training example, every epoch, goes through augment"
    torch.manual_seed(0)
    again = _model()
    fit(again, inputs, targets, epochs=2, batch_size=16, augment=augment, progress=False)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b), "the same seed gives the same augmented run"
    torch.manual_seed(0)
    plain = _model()
    fit(plain, inputs, targets, epochs=2, batch_size=16, progress=False)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters())), "augment was applied"


def test_predict_averages_the_softmax_over_views():
    class Votes(nn.Module):
        """Logits that make class 0 likely on x and class 1 very likely on -x."""

        def forward(self, x):
            return torch.stack((x[:, 0], 3 * -x[:, 0]), dim=-1)  # (N, 2)

    x = torch.tensor([[1.0], [-1.0]])
    model = Votes()
    assert predict(model, x).tolist() == [0, 1]
    # Views (x, -x, -x): for x = 1, p(class 1) = (sigmoid(-4) + 2 sigmoid(4)) / 3 = 0.66 -> 1; for x = -1,
    # (sigmoid(4) + 2 sigmoid(-4)) / 3 = 0.34 -> 0. Plain predictions say the opposite.
    averaged = predict(model, x, views=lambda batch: [batch, -batch, -batch])
    assert averaged.tolist() == [1, 0]
    assert accuracy(model, x, torch.tensor([1, 0]), views=lambda batch: [batch, -batch, -batch]) == 1.0
    with pytest.raises(ValueError, match="no versions"):
        predict(model, x, views=lambda batch: [])


def test_inputs_may_be_a_tuple_passed_as_model_arguments():
    """(features, lengths) batches reach ``model(features, lengths)``, row for row, in fit, predict and accuracy."""

    class LastReal(nn.Module):  # reads the feature of each row's last real position: needs its length
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(1, 2)

        def forward(self, x, lengths):
            return self.head(x[torch.arange(x.shape[0]), lengths - 1, None])

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 6, (256,), generator=gen)
    x = torch.randn(256, 5, generator=gen)
    y = (x[torch.arange(256), lengths - 1] > 0).long()
    torch.manual_seed(0)
    model = LastReal()
    history = fit(model, (x, lengths), y, epochs=20, batch_size=32, lr=5e-2, eval_data=((x, lengths), y), progress=False)
    assert history.eval_accuracy[-1] > 0.95
    assert accuracy(model, (x, lengths), y) == history.eval_accuracy[-1]
    batches = list(iterate_batches((x, lengths), y, batch_size=100, shuffle=True, generator=torch.Generator().manual_seed(1)))
    for (bx, bl), by in batches:
        assert torch.equal(by, (bx[torch.arange(len(bx)), bl - 1] > 0).long())  # rows kept together
    with pytest.raises(ValueError, match="same length"):
        list(iterate_batches((x, lengths[:10]), y, batch_size=2))
