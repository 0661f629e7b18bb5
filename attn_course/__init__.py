"""attn_course: the tested PyTorch implementations behind the attn-course notebooks.

Shape legend used everywhere: B batch, H heads, L query length, S key length,
D head dim, E model dim. Masks are boolean with True = may attend.
"""

from .attention import scaled_dot_product_attention, stable_softmax
from .device import describe_device, pick_device, seed_everything
from .masks import (
    causal_mask,
    combine_masks,
    from_blocked_mask,
    fully_masked_rows,
    mask_to_bias,
    padding_mask,
    to_blocked_mask,
)
from .multihead import MultiHeadAttention, merge_heads, split_heads

__version__ = "0.1.0"

__all__ = [
    "MultiHeadAttention",
    "causal_mask",
    "combine_masks",
    "describe_device",
    "from_blocked_mask",
    "fully_masked_rows",
    "mask_to_bias",
    "merge_heads",
    "padding_mask",
    "pick_device",
    "scaled_dot_product_attention",
    "seed_everything",
    "split_heads",
    "stable_softmax",
    "to_blocked_mask",
]
