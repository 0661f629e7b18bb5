"""attn_course: the tested PyTorch implementations behind the attn-course notebooks.

Shape legend used everywhere: B batch, H heads, L query length, S key length,
D head dim, E model dim. Masks are boolean with True = may attend.
"""

from .attention import scaled_dot_product_attention, stable_softmax
from .claims import ClaimError, claim
from .chunked import (
    PartialAttention,
    chunked_attention,
    finish_partial,
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
    track_gradient_norms,
)
from .distributed import (
    CommunicationLog,
    gather_sequence,
    log_communication,
    ring_attention,
    ring_step,
    ring_step_backward,
    run_distributed,
    run_sharded_attention,
    run_sharded_attention_batch,
    sequence_positions,
    shard_sequence,
    ulysses_attention,
)
from .dynamic import DynamicHeadAttention
from .grouped import GroupedQueryAttention, compare_kv_cache_memory, grouped_attention, kv_cache_bytes, repeat_kv
from .kv_cache import KVCache, decode_step, measure_decoding_speed
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
    "claim",
    "ClaimError",
    "combine_masks",
    "CommunicationLog",
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
    "gather_sequence",
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
    "LinearAttentionState",
    "log_communication",
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
    "ring_attention",
    "ring_step",
    "ring_step_backward",
    "RotaryEmbedding",
    "run_distributed",
    "run_sharded_attention",
    "run_sharded_attention_batch",
    "scaled_dot_product_attention",
    "seed_everything",
    "sequence_positions",
    "shard_sequence",
    "sinusoidal_encoding",
    "SinusoidalPositionalEncoding",
    "sparse_attention",
    "SparseAttention",
    "split_heads",
    "stable_softmax",
    "to_blocked_mask",
    "track_gradient_norms",
    "ulysses_attention",
    "VisionTransformer",
    "ViTConfig",
]
