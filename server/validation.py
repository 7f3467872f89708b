"""Reply validation: every train and evaluate reply is checked before anything is averaged.

A train reply is dropped, with a one-line reason, when it carries an error, has other than one
ArrayRecord and one MetricRecord, misses or adds a key, has a width tier the run does not know or other
than the tier the server holds for that node, lacks a positive ``num-examples``, or holds an array of the
wrong dtype or shape, one larger in bytes than its shape needs (checked before it is decoded), one that
does not decode, or one with NaN, Inf or absurdly large values. An evaluate reply is dropped when it
carries an error, or its one MetricRecord is not exactly the evaluate metrics, finite, with a positive
whole ``num-examples``. Nothing here raises on bad input: the strategy only ever sees valid replies.
Well-formed hostile replies (inflated counts, scaled weights) pass here; :mod:`glmc.merging.robust` bounds them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from federation import protocol

# Trained weights are O(1); anything this large is corrupt or hostile, and would swamp the mean.
MAX_ABS_VALUE = 1e4
MAX_EXAMPLES = 10**9
TIER_TOLERANCE = 1e-9
NPY_HEADER_BYTES = 4096  # an .npy header is 128 bytes for these shapes; anything past this slack is not the array

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


def check_reply(msg: Message, schema: ReplySchema, owned_tier: float | None = None) -> str | None:
    """None if ``msg`` is a valid train reply, else the one-line reason it is not. ``owned_tier``: the width tier
    the server holds for the sending node (a reply never changes it), None for a node not heard from yet."""
    try:
        content, reason = _envelope(msg, arrays=1)
        if reason is not None:
            return reason
        metrics = next(iter(content.metric_records.values()))
        reason = _check_metrics(metrics, schema.metric_keys)
        if reason is not None:
            return reason
        tier = schema.tier(float(metrics[protocol.TIER_KEY]))  # type: ignore[arg-type]
        if tier is None:
            return f"unknown width tier {metrics[protocol.TIER_KEY]!r}; known: {sorted(schema.shapes)}"
        if owned_tier is not None and tier != owned_tier:
            return f"width tier {tier:g}, but the server holds tier {owned_tier:g} for this node"
        return _check_arrays(next(iter(content.array_records.values())), schema.shapes[tier], schema.dtype)
    except Exception as err:  # a hostile reply must never take the strategy down
        return f"unreadable reply: {type(err).__name__}: {err}".splitlines()[0]


def check_evaluate_reply(msg: Message, metric_keys: frozenset[str] = protocol.EVALUATE_METRICS) -> str | None:
    """None if ``msg`` is a valid evaluate reply (one MetricRecord of exactly ``metric_keys``), else why not."""
    try:
        content, reason = _envelope(msg, arrays=0)
        return reason or _check_metrics(next(iter(content.metric_records.values())), metric_keys)
    except Exception as err:
        return f"unreadable reply: {type(err).__name__}: {err}".splitlines()[0]


def _envelope(msg: Message, arrays: int) -> tuple[RecordDict, str | None]:
    """(content, None) if ``msg`` has no error and holds ``arrays`` ArrayRecords and one MetricRecord."""
    if msg.has_error():
        return RecordDict(), f"client error: {msg.error.reason}".splitlines()[0]
    if not msg.has_content():
        return RecordDict(), "empty reply"
    content = msg.content
    if len(content.array_records) != arrays or len(content.metric_records) != 1:
        return content, (f"expected {'one' if arrays else 'no'} ArrayRecord and one MetricRecord, got "
                         f"{len(content.array_records)} and {len(content.metric_records)}")
    return content, None


def _check_metrics(metrics: MetricRecord, expected: frozenset[str]) -> str | None:
    """The first problem with a reply's metrics: keys, finiteness, a positive whole ``num-examples``."""
    keys = set(metrics.keys())
    if keys != expected:
        return _key_difference("metric", keys, set(expected))
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"metric {key!r} is not a finite number: {value!r}"
    examples = metrics[protocol.WEIGHT_KEY]
    if not (0 < examples <= MAX_EXAMPLES) or float(examples) != int(examples):  # type: ignore[operator, arg-type]
        return f"{protocol.WEIGHT_KEY} must be a positive whole number, got {examples!r}"
    return None


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
    limit = math.prod(shape) * np.dtype(dtype).itemsize + NPY_HEADER_BYTES
    if len(array.data) > limit:  # before decoding: a reply never makes the server allocate more than it expects
        return f"array {key!r} is {len(array.data)} bytes, more than the {limit} its shape needs"
    values = array.numpy()  # np.load with allow_pickle=False: never unpickles
    if str(values.dtype) != dtype or values.shape != shape:
        return f"array {key!r} decodes to {values.dtype}{list(values.shape)}, not its header {dtype}{list(shape)}"
    if not np.isfinite(values).all():
        return f"array {key!r} has NaN or Inf values"
    if values.size and np.abs(values).max() > MAX_ABS_VALUE:
        return f"array {key!r} has values beyond ±{MAX_ABS_VALUE:g}"
    return None


def check_model(arrays: ArrayRecord, bound: float = MAX_ABS_VALUE) -> str | None:
    """None if every value of a merged model is finite and within ±``bound`` (what a reply may hold), else why."""
    for key, array in arrays.items():
        values = array.numpy()
        if not np.isfinite(values).all():
            return f"array {key!r} has NaN or Inf values"
        if values.size and np.abs(values).max() > bound:
            return f"array {key!r} reaches {np.abs(values).max():.3g}, beyond ±{bound:g}"
    return None


def _key_difference(what: str, got: set[str], expected: set[str]) -> str:
    missing, extra = sorted(expected - got), sorted(got - expected)
    parts = ([f"missing {what} keys {missing[:3]}"] if missing else []) + (
        [f"extra {what} keys {extra[:3]}"] if extra else [])
    return "; ".join(parts)


def split_replies(replies: Iterable[Message], schema: ReplySchema, addressees: Mapping[str, int] | None = None,
                  tiers: Mapping[int, float] | None = None) -> tuple[list[Message], list[tuple[int, str]]]:
    """(valid replies in a canonical order, [(node id, reason)] for the dropped ones).

    The valid replies are sorted by a digest of their arrays, not kept in arrival order: float sums depend on
    their order, so without it two runs of one seed drift apart by rounding from the first average on.
    ``addressees`` maps instruction message ids to the node each was sent to: an error reply that the
    SuperLink makes for a node that went away carries the SuperLink's own id as its source, not the node's.
    ``tiers`` maps node ids (a reply's source) to the width tier the server holds for each (:func:`check_reply`).
    """
    valid, dropped = [], []
    for msg in replies:
        sender = _sender(msg)
        reason = check_reply(msg, schema, None if sender is None else (tiers or {}).get(sender))
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


def _sender(msg: Message) -> int | None:
    """The node a reply comes from (a valid reply's own source; the strategy keys node tiers by it)."""
    try:
        return int(msg.metadata.src_node_id)
    except Exception:
        return None


def _source(msg: Message, addressees: Mapping[str, int]) -> int:
    try:
        return int(addressees.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id))
    except Exception:  # metadata is flwr's; a reply without it still gets a reason logged
        return -1
