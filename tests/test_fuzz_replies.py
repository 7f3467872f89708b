"""Fuzzing the strategy's reply validation with real flwr Messages: 240 malformed train replies, seeded.

Each reply breaks the protocol in one or more random ways: array shapes, keys, dtypes, NaN/Inf, huge
values, forged or pickled payloads, empty records, missing or absurd ``num-examples``, unknown width
tiers, bad metrics, client errors. Every one must be rejected with a one-line reason, none may raise out
of ``aggregate_train``, and the global model must be exactly what the valid replies alone give.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from test_strategy import as_numpy, good_replies, instruction, metrics, schema, state, strategy

from federation import protocol
from server.validation import check_reply

SEED = 20240607
CASES = 240
PWNED: list[str] = []  # a pickled payload that ever got unpickled would append here


def _pwned() -> None:
    PWNED.append("unpickled")


class Payload:
    """Unpickling this runs ``_pwned``: the test fails if the server ever unpickles a client payload."""

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return _pwned, ()


Arrays = dict[str, Array]
Metrics = dict[str, object]


def _key(rng: np.random.Generator, arrays: Arrays) -> str:
    """A random key of ``arrays`` (an earlier mutation may have emptied it: then a stray one)."""
    if not arrays:
        arrays["ghost"] = Array(np.zeros(2, dtype=np.float32))
    return str(rng.choice(sorted(arrays)))


def _values(array: Array) -> np.ndarray:
    """The decoded values, or zeros of the header's shape when an earlier mutation forged the payload."""
    try:
        return array.numpy().copy()
    except ValueError:
        return np.zeros(array.shape, dtype=np.float32)


def break_shape(rng: np.random.Generator, arrays: Arrays, _: Metrics) -> None:
    key = _key(rng, arrays)
    shape = list(arrays[key].shape)
    choice = rng.integers(3)
    if choice == 0:
        shape.append(int(rng.integers(1, 4)))
    elif choice == 1 and shape:
        shape.pop()
    else:
        shape = [max(1, d + int(rng.choice([-1, 1]))) for d in shape] or [2]
    arrays[key] = Array(rng.standard_normal(shape).astype(np.float32))


def drop_keys(rng: np.random.Generator, arrays: Arrays, _: Metrics) -> None:
    for key in rng.choice(sorted(arrays), size=min(len(arrays), int(rng.integers(1, 4))), replace=False):
        del arrays[str(key)]


def add_key(rng: np.random.Generator, arrays: Arrays, _: Metrics) -> None:
    arrays[f"blocks.{rng.integers(9)}.evil.{rng.integers(1000)}"] = Array(np.zeros(3, dtype=np.float32))


def rename_key(rng: np.random.Generator, arrays: Arrays, _: Metrics) -> None:
    key = _key(rng, arrays)
    arrays[key + ".x"] = arrays.pop(key)


def change_dtype(rng: np.random.Generator, arrays: Arrays, _: Metrics) -> None:
    key = _key(rng, arrays)
    dtype = rng.choice(["float64", "float16", "int32", "int64", "uint8", "bool", "complex64"])
    arrays[key] = Array(_values(arrays[key]).astype(dtype))


def poison_value(rng: np.random.Generator, arrays: Arrays, _: Metrics) -> None:
    """One entry NaN, ±Inf or beyond the bound (1e5 to 1e30)."""
    key = _key(rng, arrays)
    values = _values(arrays[key])
    kind = rng.integers(3)
    bad = math.nan if kind == 0 else math.inf * rng.choice([-1, 1]) if kind == 1 else \
        float(rng.choice([-1, 1]) * 10 ** rng.uniform(5, 30))
    values.reshape(-1)[rng.integers(values.size)] = np.float32(bad)
    arrays[key] = Array(values)


def forge_payload(rng: np.random.Generator, arrays: Arrays, _: Metrics) -> None:
    """A header that promises the right dtype and shape over bytes that are not that array."""
    key = _key(rng, arrays)
    real = arrays[key]
    kind = rng.integers(4)
    if kind == 0:
        data = rng.bytes(int(rng.integers(0, 64)))
    elif kind == 1:
        data = real.data[: len(real.data) // 2]  # truncated
    elif kind == 2:
        buffer = io.BytesIO()
        np.save(buffer, np.zeros(real.shape, dtype=np.float64))  # a valid .npy of another dtype
        data = buffer.getvalue()
    else:
        buffer = io.BytesIO()
        np.save(buffer, np.array([Payload()], dtype=object), allow_pickle=True)  # a pickle bomb
        data = buffer.getvalue()
    arrays[key] = Array(dtype=real.dtype, shape=real.shape, stype=real.stype, data=data)


def empty_arrays(rng: np.random.Generator, arrays: Arrays, _: Metrics) -> None:
    arrays.clear()


def bad_examples(rng: np.random.Generator, _: Arrays, values: Metrics) -> None:
    values[protocol.WEIGHT_KEY] = [None, 0, -int(rng.integers(1, 10**6)), float(rng.uniform(0.1, 99.9)), 10**12,
                                   math.nan, math.inf, [1, 2]][int(rng.integers(8))]


def bad_tier(rng: np.random.Generator, _: Arrays, values: Metrics) -> None:
    values[protocol.TIER_KEY] = [0.5, 0.25, 0.3, 2.0, 0.0, -1.0, math.nan, None][int(rng.integers(8))]


def bad_metric(rng: np.random.Generator, _: Arrays, values: Metrics) -> None:
    key = str(rng.choice(sorted(protocol.TRAIN_METRICS - {protocol.WEIGHT_KEY, protocol.TIER_KEY})))
    kind = rng.integers(4)
    if kind == 0:
        values[key] = None  # missing
    elif kind == 1:
        values[key] = [math.nan, -math.inf][int(rng.integers(2))]
    elif kind == 2:
        values[key] = [0.5, 0.25]
    else:
        values[f"surprise-{rng.integers(100)}"] = 1.0


MUTATIONS = [break_shape, drop_keys, add_key, rename_key, change_dtype, poison_value, forge_payload, empty_arrays,
             bad_examples, bad_tier, bad_metric]


def malformed_reply(rng: np.random.Generator, node: int) -> tuple[str, Message]:
    """(what was broken, the reply): one mutation of a valid reply (60%) or two or three; a fifth of them also
    in a broken envelope (client error, no records, a record too many or too few)."""
    envelope = rng.integers(25)
    if envelope == 0:
        return "client error", Message(Error(code=int(rng.integers(100)), reason="boom"), reply_to=instruction(node))
    if envelope == 1:
        return "empty content", Message(RecordDict(), reply_to=instruction(node))
    arrays: Arrays = dict(ArrayRecord(state(int(rng.integers(1000)))).items())  # type: ignore[arg-type]
    values: Metrics = {key: value for key, value in metrics().items()}
    chosen = rng.choice(len(MUTATIONS), size=1 if rng.random() < 0.6 else int(rng.integers(2, 4)), replace=False)
    for index in chosen:
        MUTATIONS[index](rng, arrays, values)
    content = RecordDict({protocol.ARRAYS: ArrayRecord(arrays),  # type: ignore[arg-type]
                          protocol.METRICS: MetricRecord({k: v for k, v in values.items() if v is not None})})
    if envelope == 2:
        content["more"] = ArrayRecord({"x": Array(np.zeros(2, dtype=np.float32))})  # type: ignore[arg-type]
    elif envelope == 3:
        del content[protocol.METRICS]
    elif envelope == 4:
        content["config"] = ConfigRecord({"a": 1})
        del content[protocol.ARRAYS]
    return "+".join(MUTATIONS[i].__name__ for i in chosen) + f" (envelope {envelope})", Message(
        content, reply_to=instruction(node))


def fuzz_cases() -> list[tuple[str, Message]]:
    rng = np.random.default_rng(SEED)
    return [malformed_reply(rng, node=100 + i) for i in range(CASES)]


def test_fuzz_cases_are_deterministic_and_varied() -> None:
    first, second = fuzz_cases(), fuzz_cases()
    assert [name for name, _ in first] == [name for name, _ in second]
    assert len(first) >= 200
    names = " ".join(name for name, _ in first)
    assert all(m.__name__ in names for m in MUTATIONS) and "client error" in names and "empty content" in names


def test_every_malformed_reply_is_rejected_with_a_reason() -> None:
    reasons = {}
    for name, bad in fuzz_cases():
        reason = check_reply(bad, schema())
        assert reason is not None, f"accepted a malformed reply: {name}"
        assert reason and "\n" not in reason, name
        reasons[name] = reason
    assert not PWNED, "a client payload was unpickled"


@pytest.mark.parametrize("aggregation", ["fedavg", "weight"])
def test_malformed_replies_never_reach_the_global_model(aggregation: str, caplog: pytest.LogCaptureFixture) -> None:
    """One by one beside two valid replies (fedavg; every 8th case through weight alignment), then all at once."""
    good = good_replies()[:2]
    clean, _ = strategy(aggregation).aggregate_train(1, good)
    assert clean is not None
    expected = as_numpy(clean)
    cases = fuzz_cases() if aggregation == "fedavg" else fuzz_cases()[::8]
    for name, bad in cases:
        s = strategy(aggregation)
        arrays, _ = s.aggregate_train(1, [*good, bad])  # raises nothing, whatever the reply
        assert arrays is not None, name
        got = as_numpy(arrays)
        assert all(np.array_equal(got[k], expected[k]) for k in expected), f"the global model moved: {name}"
        assert s.current.valid == 2 and len(s.current.dropped) == 1, name

    s = strategy(aggregation)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        arrays, _ = s.aggregate_train(1, [*good, *(bad for _, bad in cases)])
    assert arrays is not None and all(np.array_equal(as_numpy(arrays)[k], expected[k]) for k in expected)
    assert s.current.valid == 2 and len(s.current.dropped) == len(cases)
    assert sum("dropped reply" in r.getMessage() for r in caplog.records) == len(cases)
    assert s.aggregate_train(1, [bad for _, bad in cases]) == (None, None)  # nothing valid: keep the global model
    assert not PWNED, "a client payload was unpickled"
