"""Every graded task, by id. Each lesson's tasks live in ``lessonNN.py``."""

from __future__ import annotations

from ..core import Task
from . import lesson01, lesson02, lesson03, lesson04, lesson05, lesson06, lesson07, lesson08, lesson09, lesson10, lesson11, lesson12

__all__ = ["TASKS", "tasks_for_lesson"]

TASKS: dict[str, Task] = {
    task.id: task
    for task in (
        lesson01.STABLE_SOFTMAX,
        lesson01.ATTENTION,
        lesson01.ADDITIVE_ATTENTION,
        lesson02.SPLIT_HEADS,
        lesson02.MERGE_HEADS,
        lesson02.MHA_FORWARD,
        lesson02.PRUNE_HEADS,
        lesson03.CAUSAL_MASK,
        lesson03.PADDING_MASK,
        lesson03.MASKED_ATTENTION,
        lesson03.CROSS_ATTENTION_MASK,
        lesson04.ATTENTION_FLOPS,
        lesson04.SAVED_TENSOR_BYTES,
        lesson05.SLIDING_WINDOW_MASK,
        lesson05.BLOCK_LOCAL_ATTENTION,
        lesson05.DILATED_WINDOW_ATTENTION,
        lesson06.LINEAR_ATTENTION,
        lesson06.CAUSAL_LINEAR_ATTENTION,
        lesson06.CHUNKWISE_CAUSAL_LINEAR_ATTENTION,
        lesson07.MERGE_PARTIALS,
        lesson07.ONLINE_SOFTMAX_ATTENTION,
        lesson08.ATTENTION_ENTROPY,
        lesson08.QK_NORM_ATTENTION,
        lesson08.FIRST_NONFINITE_MODULE,
        lesson08.FIRST_NONFINITE_GRADIENT,
        lesson09.PATCHIFY,
        lesson09.CLASS_TOKEN_AND_POSITIONS,
        lesson09.VIT_ATTENTION,
        lesson10.REL_SHIFT,
        lesson10.CONV_MODULE,
        lesson10.STREAMING_CONV,
        lesson11.REPEAT_KV,
        lesson11.DECODE_ATTENTION,
        lesson11.ROTARY,
        lesson11.ROPE_GENERATION,
        lesson12.ZIGZAG_POSITIONS,
        lesson12.RING_STEP,
        lesson12.RING_STEP_BACKWARD,
    )
}


def tasks_for_lesson(number: str) -> list[Task]:
    """The tasks of lesson ``number`` (e.g. ``"03"``), in definition order."""
    return [task for task in TASKS.values() if task.id.split(".")[0] == number]
