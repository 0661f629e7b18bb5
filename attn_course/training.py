"""A small, readable training loop for the lessons' demos: batches, AdamW, a tqdm bar, a history.

Every lesson that trains a model -- lessons 02 (heads), 08 (debugging), 09 (ViT), 10 (Conformer)
and 11 (dynamic heads) -- uses ``fit`` and ``accuracy`` from here, so the loop is written (and
tested) once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

__all__ = ["History", "iterate_batches", "fit", "accuracy", "predict"]


@dataclass
class History:
    """Per-epoch training loss and (if an evaluation set was given) evaluation accuracy."""

    train_loss: list[float] = field(default_factory=list)
    eval_accuracy: list[float] = field(default_factory=list)
    seconds: float = 0.0


#: A model's input: one tensor, or a tuple of tensors passed as ``model(*inputs)`` (e.g. features and lengths).
Inputs = torch.Tensor | tuple[torch.Tensor, ...]


def _first(inputs: Inputs) -> torch.Tensor:
    return inputs[0] if isinstance(inputs, tuple) else inputs


def _take(inputs: Inputs, index: torch.Tensor | slice) -> Inputs:
    return tuple(part[index] for part in inputs) if isinstance(inputs, tuple) else inputs[index]


def _call(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def iterate_batches(
    inputs: Inputs,
    targets: torch.Tensor,
    *,
    batch_size: int,
    shuffle: bool = False,
    generator: torch.Generator | None = None,
) -> Iterator[tuple[Inputs, torch.Tensor]]:
    """Yield ``(inputs[i:j], targets[i:j])`` mini-batches along the first dim (of every tensor of a tuple)."""
    n = _first(inputs).shape[0]
    if any(part.shape[0] != n for part in (inputs if isinstance(inputs, tuple) else ())) or targets.shape[0] != n:
        raise ValueError(f"inputs and targets must have the same length, got {n} and {targets.shape[0]}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = _first(inputs).device
    order = torch.randperm(n, generator=generator).to(device) if shuffle else torch.arange(n, device=device)
    for start in range(0, n, batch_size):
        index = order[start : start + batch_size]
        yield _take(inputs, index), targets[index]


def _default_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dim of ``logits``; works for (N, C) and (N, T, C) outputs."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def predict(model: nn.Module, inputs: Inputs, *, batch_size: int = 512) -> torch.Tensor:
    """``argmax`` predictions of ``model`` over ``inputs``, in evaluation mode."""
    was_training = model.training
    model.eval()
    n = _first(inputs).shape[0]
    predictions = [_call(model, _take(inputs, slice(i, i + batch_size))).argmax(-1) for i in range(0, n, batch_size)]
    model.train(was_training)
    return torch.cat(predictions)


def accuracy(model: nn.Module, inputs: Inputs, targets: torch.Tensor, *, batch_size: int = 512) -> float:
    """Fraction of correct ``argmax`` predictions (over every position for sequence outputs)."""
    return (predict(model, inputs, batch_size=batch_size) == targets).float().mean().item()


def fit(
    model: nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    *,
    epochs: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _default_loss,
    eval_data: tuple[torch.Tensor, torch.Tensor] | None = None,
    warmup_steps: int = 0,
    grad_clip: float | None = 1.0,
    seed: int = 0,
    progress: bool = True,
    description: str = "training",
) -> History:
    """Train ``model`` with AdamW (or ``optimizer``) and a cosine schedule; return its ``History``.

    A tqdm bar shows the epoch and the running loss, and one line at the end sums the run up
    (``progress=False`` silences both). ``eval_data`` = ``(inputs, targets)`` adds the
    accuracy after every epoch. Shuffling uses its own generator seeded with ``seed``. ``inputs``
    (and the inputs of ``eval_data``) may be a tuple of tensors, passed as ``model(*inputs)``.
    """
    import time

    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps_per_epoch = math.ceil(_first(inputs).shape[0] / batch_size)
    total_steps = epochs * steps_per_epoch
    base_lrs = [group["lr"] for group in optimizer.param_groups]

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress_fraction = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress_fraction))

    generator = torch.Generator().manual_seed(seed)
    history = History()
    start = time.perf_counter()
    step = 0
    bar = tqdm(total=total_steps, desc=description, disable=not progress, leave=True)
    model.train()
    for epoch in range(epochs):
        epoch_loss, seen = 0.0, 0
        for batch_inputs, batch_targets in iterate_batches(
            inputs, targets, batch_size=batch_size, shuffle=True, generator=generator
        ):
            for group, base in zip(optimizer.param_groups, base_lrs):
                group["lr"] = base * lr_factor(step)
            loss = loss_fn(_call(model, batch_inputs), batch_targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            epoch_loss += loss.item() * batch_targets.shape[0]
            seen += batch_targets.shape[0]
            step += 1
            bar.update(1)
        history.train_loss.append(epoch_loss / seen)
        postfix = {"epoch": epoch + 1, "loss": f"{history.train_loss[-1]:.3f}"}
        if eval_data is not None:
            history.eval_accuracy.append(accuracy(model, *eval_data))
            postfix["acc"] = f"{history.eval_accuracy[-1]:.3f}"
        bar.set_postfix(postfix)
    bar.close()
    history.seconds = time.perf_counter() - start
    if progress:  # a plain line too: a saved notebook shows it where a widget bar cannot render
        summary = f"{description}: {epochs} epochs ({total_steps} steps), final training loss {history.train_loss[-1]:.3g}"
        if history.eval_accuracy:
            summary += f", eval accuracy {history.eval_accuracy[-1]:.3f}"
        print(summary)
    return history
