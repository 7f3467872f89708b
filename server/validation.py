"""Reply validation: every train reply is checked before anything is averaged.

A reply is dropped, with a one-line reason, when it carries an error, has other than one
ArrayRecord and one MetricRecord, misses or adds a key, has a width tier the run does not know,
lacks a positive ``num-examples``, or holds an array of the wrong dtype or shape, one that does
not decode, or one with NaN, Inf or absurdly large values. Nothing here raises on bad input:
the strategy only ever sees valid replies, so the global model never takes in a bad value.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord

from server import protocol

# Trained weights are O(1); anything this large is corrupt or hostile, and would swamp the mean.
MAX_ABS_VALUE = 1e4
MAX_EXAMPLES = 10**9
TIER_TOLERANCE = 1e-9

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class ReplySchema:
    """What a valid train reply looks like: the array shapes of each known width tier, and the metric keys."""

    shapes: Mapping[float, Shapes]
    metric_keys: frozenset[str] = protocol.TRAIN_METRICS
    dtype: str = protocol.WIRE_DTYPE

    def tier(self, value: float) -> float | None:
        """The known tier equal to ``value`` (within rounding), or None."""
        return next((t for t in self.shapes if abs(t - value) <= TIER_TOLERANCE), None)


def check_reply(msg: Message, schema: ReplySchema) -> str | None:
    """None if ``msg`` is a valid train reply, else the one-line reason it is not."""
    try:
        if msg.has_error():
            return f"client error: {msg.error.reason}".splitlines()[0]
        if not msg.has_content():
            return "empty reply"
        content = msg.content
        if len(content.array_records) != 1 or len(content.metric_records) != 1:
            return (f"expected one ArrayRecord and one MetricRecord, got {len(content.array_records)} and "
                    f"{len(content.metric_records)}")
        metrics = next(iter(content.metric_records.values()))
        reason, tier = _check_metrics(metrics, schema)
        if reason is not None or tier is None:
            return reason
        return _check_arrays(next(iter(content.array_records.values())), schema.shapes[tier], schema.dtype)
    except Exception as err:  # a hostile reply must never take the strategy down
        return f"unreadable reply: {type(err).__name__}: {err}".splitlines()[0]


def _check_metrics(metrics: MetricRecord, schema: ReplySchema) -> tuple[str | None, float | None]:
    """(reason, None) for bad metrics, else (None, the reply's known width tier)."""
    keys = set(metrics.keys())
    if keys != schema.metric_keys:
        return _key_difference("metric", keys, set(schema.metric_keys)), None
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"metric {key!r} is not a finite number: {value!r}", None
    examples = metrics[protocol.WEIGHT_KEY]
    if not (0 < examples <= MAX_EXAMPLES) or float(examples) != int(examples):  # type: ignore[operator, arg-type]
        return f"{protocol.WEIGHT_KEY} must be a positive whole number, got {examples!r}", None
    tier = schema.tier(float(metrics[protocol.TIER_KEY]))  # type: ignore[arg-type]
    if tier is None:
        return f"unknown width tier {metrics[protocol.TIER_KEY]!r}; known: {sorted(schema.shapes)}", None
    return None, tier


def _check_arrays(arrays: ArrayRecord, shapes: Shapes, dtype: str) -> str | None:
    """The first problem with the arrays of a reply at a known tier, or None."""
    keys = set(arrays.keys())
    if keys != set(shapes):
        return _key_difference("array", keys, set(shapes))
    for key, array in arrays.items():
        reason = _check_array(key, array, shapes[key], dtype)
        if reason is not None:
            return reason
    return None


def _check_array(key: str, array: Array, shape: tuple[int, ...], dtype: str) -> str | None:
    """Header first (cheap), then the decoded values, which must agree with the header."""
    if array.dtype != dtype or tuple(array.shape) != shape:
        return f"array {key!r} is {array.dtype}{list(array.shape)}, expected {dtype}{list(shape)}"
    values = array.numpy()  # np.load with allow_pickle=False: never unpickles
    if str(values.dtype) != dtype or values.shape != shape:
        return f"array {key!r} decodes to {values.dtype}{list(values.shape)}, not its header {dtype}{list(shape)}"
    if not np.isfinite(values).all():
        return f"array {key!r} has NaN or Inf values"
    if values.size and np.abs(values).max() > MAX_ABS_VALUE:
        return f"array {key!r} has values beyond ±{MAX_ABS_VALUE:g}"
    return None


def _key_difference(what: str, got: set[str], expected: set[str]) -> str:
    missing, extra = sorted(expected - got), sorted(got - expected)
    parts = ([f"missing {what} keys {missing[:3]}"] if missing else []) + (
        [f"extra {what} keys {extra[:3]}"] if extra else [])
    return "; ".join(parts)


def split_replies(replies: Iterable[Message], schema: ReplySchema,
                  addressees: Mapping[str, int] | None = None) -> tuple[list[Message], list[tuple[int, str]]]:
    """(valid replies in a canonical order, [(node id, reason)] for the dropped ones).

    The valid replies are sorted by a digest of their arrays, not kept in arrival order: float sums depend on
    their order, so without it two runs of one seed drift apart by rounding from the first average on.
    ``addressees`` maps instruction message ids to the node each was sent to: an error reply that the
    SuperLink makes for a node that went away carries the SuperLink's own id as its source, not the node's.
    """
    valid, dropped = [], []
    for msg in replies:
        reason = check_reply(msg, schema)
        if reason is None:
            valid.append(msg)
        else:
            dropped.append((_source(msg, addressees or {}), reason))
    return sorted(valid, key=_content_digest), dropped


def _content_digest(msg: Message) -> str:
    """SHA-256 over a valid reply's array names and bytes: the same trained models sort the same way."""
    digest = hashlib.sha256()
    for record in msg.content.array_records.values():
        for key, array in sorted(record.items()):
            digest.update(key.encode())
            digest.update(array.data)
    return digest.hexdigest()


def _source(msg: Message, addressees: Mapping[str, int]) -> int:
    try:
        return int(addressees.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id))
    except Exception:  # metadata is flwr's; a reply without it still gets a reason logged
        return -1
