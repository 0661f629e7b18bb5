"""The shared training loop learns, reports progress, and is reproducible."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from attn_course.training import accuracy, fit, iterate_batches


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
