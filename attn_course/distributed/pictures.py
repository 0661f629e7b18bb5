"""Pictures of the ring: whose K/V block each rank holds at each step, and which rank computes each causal score.

Matplotlib is imported only when a picture is drawn. Taught in lesson 12 (attention across
devices).
"""

from __future__ import annotations

import torch

from .layout import block_plan, chunk_length, ring_schedule, sequence_positions

__all__ = ["plot_ring_schedule", "plot_causal_layout"]


def plot_ring_schedule(world_size: int, *, ax=None):
    """A grid: row = rank, column = step, each cell names (and colours) the K/V block that rank holds."""
    import matplotlib.pyplot as plt

    schedule = torch.tensor(ring_schedule(world_size))  # (W, W)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.1 * world_size + 1.6, 0.7 * world_size + 1.0))
    ax.imshow(schedule.numpy(), cmap="tab10", vmin=0, vmax=9, alpha=0.55)
    for rank in range(world_size):
        for step in range(world_size):
            ax.text(step, rank, f"K/V {int(schedule[rank, step])}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(world_size), [f"step {s}" for s in range(world_size)])
    ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
    ax.set_title("which rank's K/V block each rank holds")
    return ax.figure


def plot_causal_layout(seq_len: int, world_size: int, *, layout: str = "zigzag", ax=None):
    """The causal (L, L) score matrix, each query-key pair coloured by the rank that computes it.

    White: blocks the ring skips (entirely in the future). Pale: computed on a diagonal
    block, then masked. The colour of a row is the rank that holds that query.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    positions = sequence_positions(seq_len, world_size, layout=layout)
    owner = torch.full((seq_len, seq_len), -1.0)  # (L, L): rank computing each pair, -1 = skipped
    masked = torch.zeros(seq_len, seq_len, dtype=torch.bool)  # (L, L): computed, then masked
    for rank in range(world_size):
        for source in ring_schedule(world_size)[rank]:
            for qs, ks, causal in block_plan(positions[rank], positions[source], is_causal=True,
                                             max_run=chunk_length(seq_len // world_size, layout)):
                rows, cols = positions[rank][qs], positions[source][ks]
                owner[rows[:, None], cols[None, :]] = rank
                if causal is not None:
                    masked[rows[:, None], cols[None, :]] = ~causal
    if ax is None:
        _, ax = plt.subplots(figsize=(4, 4))
    colours = plt.get_cmap("tab10")(range(world_size))
    image = torch.ones(seq_len, seq_len, 4)  # (L, L, RGBA), white
    for rank in range(world_size):
        image[owner == rank] = torch.tensor(colours[rank], dtype=torch.float32)
    image[masked, 3] = 0.25  # masked pairs: pale
    ax.imshow(image.numpy(), interpolation="nearest")
    ax.legend(handles=[Patch(color=colours[r], label=f"rank {r}") for r in range(world_size)], loc="upper right",
              fontsize=8, frameon=False)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(f"{layout}, W={world_size}")
    return ax.figure
