"""attn_course: the tested PyTorch implementations behind the attn-course notebooks.

Shape legend used everywhere: B batch, H heads, L query length, S key length,
D head dim, E model dim. Masks are boolean with True = may attend.
"""

from .attention import scaled_dot_product_attention, stable_softmax
from .chunked import (
    PartialAttention,
    chunked_attention,
    finish_partial,
    log_sum_exp,
    merge_partials,
    partial_attention,
    query_chunked_attention,
)
from .conformer import ConformerClassifier, ConformerConfig, ConformerEncoder
from .device import describe_device, pick_device, seed_everything
from .diagnostics import (
    AttentionCapture,
    AttentionRecord,
    GradientNormHistory,
    NonFiniteError,
    NonFiniteEvent,
    NonFiniteTracker,
    attention_entropy,
    attention_stats,
    capture_attention,
    find_nonfinite,
    format_gradient_norms,
    gradient_norms,
    token_influence,
    track_gradient_norms,
)
from .dynamic import DynamicHeadAttention
from .grouped import GroupedQueryAttention, grouped_attention, repeat_kv
from .kv_cache import KVCache, compare_kv_cache_memory, decode_step, kv_cache_bytes, measure_decoding_speed
from .linear import (
    LinearAttentionState,
    RandomFeatureMap,
    elu_feature_map,
    linear_attention,
    linear_attention_quadratic,
    linear_attention_step,
    relu_feature_map,
)
from .masks import (
    causal_mask,
    combine_masks,
    from_blocked_mask,
    fully_masked_rows,
    mask_to_bias,
    padding_mask,
    to_blocked_mask,
    with_causal,
)
from .multihead import MultiHeadAttention, merge_heads, split_heads
from .positional import (
    LearnedPositionalEmbedding,
    RelativePositionMultiHeadAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    apply_rotary,
    sinusoidal_encoding,
)
from .sparse import PATTERNS, SparseAttention, pattern_mask, sparse_attention
from .vit import VisionTransformer, ViTConfig, attention_rollout

__version__ = "0.1.0"

__all__ = [
    "apply_rotary",
    "attention_entropy",
    "attention_rollout",
    "attention_stats",
    "AttentionCapture",
    "AttentionRecord",
    "capture_attention",
    "causal_mask",
    "chunked_attention",
    "combine_masks",
    "with_causal",
    "compare_kv_cache_memory",
    "ConformerClassifier",
    "ConformerConfig",
    "ConformerEncoder",
    "decode_step",
    "describe_device",
    "DynamicHeadAttention",
    "elu_feature_map",
    "find_nonfinite",
    "finish_partial",
    "format_gradient_norms",
    "from_blocked_mask",
    "fully_masked_rows",
    "gradient_norms",
    "GradientNormHistory",
    "grouped_attention",
    "GroupedQueryAttention",
    "kv_cache_bytes",
    "KVCache",
    "LearnedPositionalEmbedding",
    "linear_attention",
    "linear_attention_quadratic",
    "linear_attention_step",
    "log_sum_exp",
    "LinearAttentionState",
    "mask_to_bias",
    "measure_decoding_speed",
    "merge_heads",
    "merge_partials",
    "MultiHeadAttention",
    "NonFiniteError",
    "NonFiniteEvent",
    "NonFiniteTracker",
    "padding_mask",
    "partial_attention",
    "PartialAttention",
    "pattern_mask",
    "PATTERNS",
    "pick_device",
    "query_chunked_attention",
    "RandomFeatureMap",
    "RelativePositionMultiHeadAttention",
    "relu_feature_map",
    "repeat_kv",
    "RotaryEmbedding",
    "scaled_dot_product_attention",
    "seed_everything",
    "sinusoidal_encoding",
    "SinusoidalPositionalEncoding",
    "sparse_attention",
    "SparseAttention",
    "split_heads",
    "stable_softmax",
    "to_blocked_mask",
    "token_influence",
    "track_gradient_norms",
    "VisionTransformer",
    "ViTConfig",
]
