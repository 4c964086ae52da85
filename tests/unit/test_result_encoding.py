"""How a result is written: a model's numpy rows straight from the array (float32 in its shortest
float32 form, reading back as the same float32 through any float64 JSON reader), everything else
exactly as before, inside the same Celery result meta."""

from __future__ import annotations

import json
from typing import Any, Literal

import msgpack
import numpy as np
import orjson
import pytest
from celery.backends.redis import RedisBackend
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from carpool.celery_edge.app import app, create_app
from carpool.celery_edge.events import short_repr, short_reprs
from carpool.celery_edge.results import FAILURE, SUCCESS, success_meta, success_row
from carpool.codec import dumps_result, float32_rows, packb_result, packb_results, storable, stored_form
from carpool.config import Settings
from carpool.gpu_worker.runner import output_rows
from tests.unit.test_codec import plain

json_app = create_app(Settings(result_serializer="json"))  # results as JSON, as before msgpack

# A float32 whose shortest form, 7.038531e-26, reads back (float64, then float32) as its neighbour:
# the double rounding float32_rows guards against.
DOUBLE_ROUNDED = np.array([363742205], dtype=np.uint32).view(np.float32)[0]

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
f32_batches = hnp.arrays(
    np.float32,
    st.tuples(st.integers(1, 6), st.integers(1, 40)),
    elements=finite_f32 | st.sampled_from([float(DOUBLE_ROUNDED), 1e-3, 1e10, 0.0, -0.0]),
)


def _encoded(value: Any) -> bytes:
    encoded = dumps_result(value)
    assert encoded is not None
    return encoded


def _read_back(row: Any, reader: Any) -> np.ndarray:
    return np.array(reader(_encoded(row)), dtype=np.float64).astype(np.float32)


@given(f32_batches)
def test_float32_rows_read_back_as_the_same_float32_values(batch: np.ndarray) -> None:
    rows = float32_rows(batch)
    assert len(rows) == len(batch)
    for row, original in zip(rows, batch, strict=True):
        for reader in (orjson.loads, json.loads):  # carpool's producer, a plain Celery client
            assert (_read_back(row, reader).view(np.uint32) == original.view(np.uint32)).all()


def test_the_double_rounding_case_is_caught_and_written_exactly() -> None:
    batch = np.full((3, 4), 0.25, dtype=np.float32)
    batch[1, 2] = DOUBLE_ROUNDED
    assert _read_back(batch[1], orjson.loads)[2] != DOUBLE_ROUNDED  # its shortest form alone is off
    rows = float32_rows(batch)
    assert isinstance(rows[0], np.ndarray) and isinstance(rows[2], np.ndarray)
    assert rows[1] == batch[1].tolist()  # that row, and only it, as exact Python floats
    assert _read_back(rows[1], orjson.loads)[2] == DOUBLE_ROUNDED


def test_float32_rows_are_about_half_the_bytes_of_their_python_floats() -> None:
    row = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    row /= np.linalg.norm(row)
    compact, as_floats = _encoded(row), _encoded(row.tolist())
    assert len(compact) < 0.65 * len(as_floats)


@given(hnp.arrays(np.float64, st.integers(1, 40), elements=st.floats(allow_nan=False, allow_infinity=False)))
def test_float64_rows_read_back_exactly(row: np.ndarray) -> None:
    assert orjson.loads(_encoded(row)) == row.tolist()
    assert json.loads(_encoded(row)) == row.tolist()


@pytest.mark.parametrize(
    "array",
    [
        np.arange(6, dtype=np.int64).reshape(2, 3),
        np.array([[True, False]]),
        np.array([[1.5, 2.25]], dtype=np.float16),
        np.arange(12, dtype=np.float32).reshape(3, 4).T,  # not C-contiguous
    ],
)
def test_other_arrays_are_written_as_the_values_they_hold(array: np.ndarray) -> None:
    assert orjson.loads(_encoded(array)) == array.tolist()
    assert stored_form(array) == array.tolist()


@given(plain)
def test_a_success_meta_is_the_dict_celery_would_encode(value: Any) -> None:
    """Byte for byte what encoding the meta dict gives, so @batched outputs read back exactly."""
    date_done = "2026-11-30T00:00:00.000000+00:00"
    for task_id in ("6f1c1e0e-0000-4000-8000-000000000000", 'odd "id" \\ é'):
        meta = {
            "status": SUCCESS,
            "result": value,
            "traceback": None,
            "children": [],  # as a Celery worker stores it: AsyncResult.children is a list
            "date_done": date_done,
            "task_id": task_id,
        }
        encoded = json_app.backend.meta_for(task_id, SUCCESS, value, date_done)
        assert encoded == orjson.dumps(meta)
        assert encoded == success_meta(orjson.dumps(value), orjson.dumps(date_done), task_id)
        assert json_app.backend.decode_result(encoded)["result"] == value
        packed = app.backend.meta_for(task_id, SUCCESS, value, date_done)  # msgpack, the default
        assert packed == msgpack.packb(meta, use_bin_type=True)  # as kombu's msgpack writes it
        assert RedisBackend.decode(app.backend, packed) == meta  # as plain Celery reads it
        # Either process reads what the other wrote, whatever its own setting.
        assert app.backend.decode_result(encoded)["result"] == value
        assert json_app.backend.decode_result(packed)["result"] == value


def test_a_float_result_stays_the_same_float() -> None:
    values = [0.1, 1 / 3, 5e-324, 1.7976931348623157e308, float(np.float32(0.1))]
    meta = app.backend.decode_result(app.backend.meta_for("t", SUCCESS, values, "2026-11-30T00:00:00"))
    assert meta["result"] == values
    assert [v.hex() for v in meta["result"]] == [v.hex() for v in values]


def test_model_outputs_become_rows() -> None:
    batch = np.ones((2, 3), dtype=np.float32)
    rows = output_rows(batch)
    assert len(rows) == 2 and all(isinstance(r, np.ndarray) and r.shape == (3,) for r in rows)
    assert output_rows(np.array([0.5, 2.0], dtype=np.float32)) == [0.5, 2.0]  # one number per row
    assert output_rows([[1, 2], [3]]) == [[1, 2], [3]]  # lists as they are
    assert all(isinstance(r, np.ndarray) for r in output_rows(np.zeros((2, 2, 2))))


class _Rounding:
    """A model whose forward gives the double-rounding float32 in its second row."""

    pad_id = 0

    def forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        out = np.full((len(ids), 4), 0.25, dtype=np.float32)
        out[1, 2] = DOUBLE_ROUNDED
        return out

    def launch(self, ids: np.ndarray, mask: np.ndarray) -> Any:
        out = self.forward(ids, mask)
        return lambda: out


@pytest.mark.parametrize("serializer", ["json", "msgpack"])
def test_the_worker_splits_a_float32_forward_for_the_serializer_that_stores_it(
    serializer: Literal["json", "msgpack"], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only JSON's decimals can read back as another float32: under json the row holding one becomes
    exact Python floats, under msgpack every row stays an array (packed from it); either way a
    reader gets the model's values exactly, through carpool.infer's batch and launch functions."""
    from carpool.gpu_worker import runner
    from carpool.models import get_model
    from carpool.models.task import InferSpec
    from carpool.names import INFER_TASK

    monkeypatch.setitem(runner._loaded, "unit-rounding", _Rounding())
    settings = Settings(result_serializer=serializer)
    backend = create_app(settings).backend
    spec = InferSpec(INFER_TASK, model_of=get_model)  # the worker's functions use the loaded model
    launch = spec.launch_function("unit-rounding", "cpu", settings)
    assert launch is not None
    for rows in (
        spec.batch_function("unit-rounding", "cpu", settings)([[1], [2], [3]], [1, 1, 1]),
        launch([[1], [2], [3]], [1, 1, 1])(),
    ):
        assert isinstance(rows[0], np.ndarray) and isinstance(rows[2], np.ndarray)
        assert isinstance(rows[1], list if serializer == "json" else np.ndarray)
        meta = backend.decode_result(backend.meta_for("t", SUCCESS, rows[1], "2026-11-30T00:00:00"))
        read = np.array(meta["result"], dtype=np.float64).astype(np.float32)
        assert (
            read.view(np.uint32).tolist()
            == _Rounding().forward(np.zeros((3, 1)), np.zeros((3, 1)))[1].view(np.uint32).tolist()
        )


def _repr_of_head(value: Any, limit: int = 200) -> str:
    """What short_repr shows, from ``repr`` itself: the first 16 items of a long list, then its length."""
    if isinstance(value, list) or (isinstance(value, tuple) and len(value) > 16):
        shown = ", ".join(map(repr, value[:16]))
        text = f"[{shown}, ... ({len(value)} items)]" if len(value) > 16 else f"[{shown}]"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[:197] + "..."


def test_a_numpy_row_shows_in_flower_as_the_list_its_reader_gets() -> None:
    row = np.arange(384, dtype=np.float32) / 384
    assert short_repr(row) == _repr_of_head(stored_form(row))  # 0.0026041667, not its float64 widening
    assert len(short_repr(row)) <= 200
    small = np.array([0.5, 1.0], dtype=np.float32)
    assert short_repr(small) == short_repr([0.5, 1.0]) == "[0.5, 1.0]"
    assert short_repr(np.array([1e-5, 3e20, 2.0], dtype=np.float32)) == "[1e-05, 3e+20, 2.0]"
    half = (np.arange(3) / 3).astype(np.float16)  # written from its Python floats
    assert short_repr(half) == "[0.0, 0.333251953125, 0.66650390625]"


numbers = st.integers(-(2**70), 2**70) | st.floats() | st.floats(-1e-3, 1e-3) | st.booleans()
lists = st.lists(numbers, max_size=40) | st.tuples(numbers, numbers) | st.lists(st.text(max_size=3))


@given(lists)
def test_a_list_shows_as_repr_shows_it(value: Any) -> None:
    assert short_repr(value) == _repr_of_head(value)


@given(f32_batches | hnp.arrays(hnp.floating_dtypes() | hnp.integer_dtypes(), st.integers(0, 40)))
def test_an_array_shows_as_repr_shows_what_its_reader_gets(array: np.ndarray) -> None:
    assert short_repr(array) == _repr_of_head(stored_form(array))


@given(
    st.lists(
        hnp.arrays(
            st.sampled_from([np.float32, np.float64]),
            st.integers(0, 40),
            elements=st.floats(width=32) | st.sampled_from([1e-5, 3e20, 0.5, -0.0]),
        )
        | hnp.arrays(np.float16, st.integers(0, 20), elements=st.floats(width=16))
        | hnp.arrays(np.int32, st.integers(0, 20))
        | hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 20)), elements=finite_f32)
        | lists,
        max_size=8,
    ),
    st.sampled_from(["msgpack", "json"]),
    st.sampled_from([200, 1024, 40]),
)
def test_a_batchs_results_show_as_each_shows_alone(values: list[Any], serializer: str, limit: int) -> None:
    """Rows of float32 and float64 beside each other, a NaN in one of them, rows shorter than the
    items shown, 2-D arrays, lists: what Flower shows of each is what short_repr shows of it alone."""
    assert short_reprs(values, limit, serializer) == [short_repr(v, limit, serializer) for v in values]


def test_stored_form_is_what_a_reader_gets() -> None:
    row = np.array([0.1, DOUBLE_ROUNDED], dtype=np.float32)
    assert stored_form(row) == orjson.loads(_encoded(row))
    assert stored_form([0.1, "x"]) == [0.1, "x"]


# --- msgpack results (CARPOOL_RESULT_SERIALIZER=msgpack, the default) ------------------------------


@given(
    f32_batches
    | hnp.arrays(
        np.float64, st.integers(0, 70_000), elements=st.floats(allow_nan=False, allow_infinity=False)
    )
)
def test_a_float_row_packs_as_the_exact_values_a_plain_celery_reader_gets(row: np.ndarray) -> None:
    """What kombu's msgpack reader (a plain Celery client) gets back is the model's values exactly:
    ``row.tolist()``, each float32 widened, not a decimal near it."""
    for one in row if row.ndim == 2 else [row]:
        packed = packb_result(one)
        assert packed is not None
        read = msgpack.unpackb(packed, raw=False)
        assert read == one.tolist() == stored_form(one, "msgpack")
        assert [v.hex() for v in read] == [v.hex() for v in one.tolist()]


def test_a_packed_float32_row_is_about_two_fifths_of_its_json() -> None:
    row = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    row /= np.linalg.norm(row)
    packed = packb_result(row)
    assert packed is not None and len(packed) == 3 + 5 * 384  # array header, then type byte + 4 bytes each
    assert len(packed) < 0.45 * len(_encoded(row))


def test_non_finite_floats_and_other_arrays_pack_as_json_would_give_them() -> None:
    """Under either serializer a reader gets None for a non-finite float, and lists of the values
    for other arrays: only the digits of a float differ between the two."""
    odd = np.array([1.5, np.nan, -np.inf], dtype=np.float32)
    assert (
        msgpack.unpackb(packb_result(odd))
        == [1.5, None, None]
        == json_app.backend.decode_result(
            json_app.backend.meta_for("t", SUCCESS, odd, "2026-11-30T00:00:00")
        )["result"]
    )
    swapped = np.array([0.1, -2.5], dtype=">f4")  # not this machine's byte order
    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1]  # not contiguous
    others = (np.arange(5), np.ones((2, 3), np.float32), np.array([True, False]), np.ones(3, np.float16))
    for array in (*others, swapped, strided):
        assert msgpack.unpackb(packb_result(array)) == array.tolist() == stored_form(array, "msgpack")


@given(
    hnp.arrays(
        st.sampled_from([np.float32, np.float64]),
        st.tuples(st.integers(1, 5), st.integers(2, 12)),
        elements=st.floats(width=32) | st.sampled_from([np.nan, np.inf, 0.5]),
    ),
    st.sampled_from(["rows", "columns", "straddling", "mixed"]),
)
def test_packing_a_batchs_results_together_packs_each_as_alone(batch: np.ndarray, split: str) -> None:
    """Rows checked finite together get the bytes each gets alone: a row of a batch with a NaN
    elsewhere still packs as a row, the row holding it as JSON would give it."""
    if split == "rows":
        values: list[Any] = list(batch)
    elif split == "columns":
        values = list(batch.T)  # views, not contiguous
    elif split == "straddling":  # rows read half an element off the grid: other values than the batch's
        half = batch.itemsize // 2
        flat = batch.reshape(-1).view(np.uint8)[half : half + (batch.size - 1) * batch.itemsize]
        values = [*list(batch), flat.view(batch.dtype)]
    else:
        values = [*list(batch), batch[0].tolist(), "text", batch, None, np.ones(3, np.float16)]
    assert packb_results(values) == [packb_result(v) for v in values]


def test_a_nan_read_across_two_finite_numbers_is_packed_as_alone() -> None:
    """A view half an element off its array's grid may read a NaN out of two finite numbers: the
    check is on the values the rows hold, not on the array they view."""
    halves = np.array([0, 0x3FF00000, 0x7FF80000, 0x3FF00000], dtype=np.uint32)  # low word first
    owner = halves.view(np.float64).copy()
    assert np.isfinite(owner).all()
    straddling = owner.view(np.uint8)[4:12].view(np.float64)
    assert np.isnan(straddling).all() and np.shares_memory(straddling, owner)
    values = [*list(owner.reshape(2, 1)), straddling]
    assert packb_results(values) == [packb_result(v) for v in values]
    assert msgpack.unpackb(packb_results(values)[2]) == [None]


def test_a_result_msgpack_cannot_carry_unchanged_fails_naming_the_json_setting() -> None:
    """That request fails, with the setting named; the batch's other results are stored."""
    import enum
    import uuid
    from datetime import UTC, datetime

    class Colour(enum.Enum):
        RED = "red"

    values = [
        datetime(2026, 1, 1, tzinfo=UTC),  # Celery's JSON tags it; msgpack has no form for it
        {1: "int key"},  # every msgpack reader refuses a non-string map key...
        ["a", {1: "b"}],  # ...wherever it is
        uuid.uuid4(),  # orjson writes these two as their values; kombu's msgpack refuses them
        {"colour": Colour.RED},
    ]
    fine = [{"fine": [1, 2.5, "x"]}, "text", 3]
    outcomes = storable("app.tag", [(True, v) for v in [*values, *fine]], "msgpack")
    assert [ok for ok, _ in outcomes] == [False] * len(values) + [True] * len(fine)
    for _, error in outcomes[: len(values)]:
        assert isinstance(error, TypeError)
        assert "app.tag returned" in str(error) and "CARPOOL_RESULT_SERIALIZER=json" in str(error)
    entries = [(f"t{i}", SUCCESS if ok else FAILURE, v) for i, (ok, v) in enumerate(outcomes)]
    stored = {task_id: app.backend.decode_result(meta) for task_id, meta in _stored(entries)}
    assert [stored[f"t{i}"]["status"] for i in range(len(entries))] == [e[1] for e in entries]
    assert [stored[f"t{i}"]["result"] for i in range(len(values), len(entries))] == fine
    # Under json Celery tags the datetime, so it is stored as before.
    assert storable("app.tag", [(True, values[0])], "json") == [(True, values[0])]


def test_an_output_shaped_like_a_kombu_tag_fails_alone_under_json_results() -> None:
    """Found by the review of @batched tasks: under CARPOOL_RESULT_SERIALIZER=json such a dict was
    stored as a success, and .get() returned bytes, or raised DecodeError (so did a gather holding
    it, for every request it waited on). msgpack has no tags: stored unchanged there."""
    from datetime import UTC, datetime

    tagged = [
        {"__type__": "bytes", "__value__": "aGk="},  # decodes, as bytes
        {"rows": [{"__type__": "datetime", "__value__": "not a date"}]},  # fails to decode, nested
    ]
    fine = [
        {"__type__": "bytes", "__value__": "aGk=", "third": 1},
        {"type": "x"},
        datetime(2026, 1, 1, tzinfo=UTC),
    ]
    outcomes = storable("app.tags", [(True, v) for v in [*tagged, *fine]], "json")
    assert [ok for ok, _ in outcomes] == [False, False, True, True, True]
    assert "gives b'aGk=' (bytes) instead" in str(outcomes[0][1])
    assert "fails on it" in str(outcomes[1][1]) and "rename the dict's keys" in str(outcomes[1][1])
    assert storable("app.tags", [(True, v) for v in tagged], "msgpack") == [(True, v) for v in tagged]
    entries = [(f"t{i}", SUCCESS if ok else FAILURE, v) for i, (ok, v) in enumerate(outcomes)]
    stored = {task_id: app.backend.decode_result(meta) for task_id, meta in _stored(entries)}
    assert [stored[f"t{i}"]["status"] for i in range(len(entries))] == [e[1] for e in entries]


class _ReprRaises:
    def __repr__(self) -> str:
        raise RuntimeError("repr exploded")


@pytest.mark.parametrize("serializer", ["json", "msgpack"])
def test_an_output_whose_repr_raises_fails_its_request_alone_naming_its_type(serializer: str) -> None:
    outcomes = storable("app.odd", [(True, "before"), (True, _ReprRaises()), (True, "after")], serializer)
    assert [ok for ok, _ in outcomes] == [True, False, True]
    error = outcomes[1][1]
    assert isinstance(error, TypeError)
    assert "app.odd returned _ReprRaises <_ReprRaises instance at" in str(error)


@pytest.mark.parametrize("serializer", ["json", "msgpack"])
def test_numpys_non_finite_float64_fails_its_request_as_a_python_nan_does(serializer: str) -> None:
    """numpy's float64 is a float subclass, which Celery's JSON encoder writes as NaN."""
    values = [np.float64("nan"), [np.float64("inf"), 1.0], {"score": np.float64("-inf")}, float("nan")]
    outcomes = storable("app.score", [(True, v) for v in values] + [(True, np.float64(0.5))], serializer)
    assert [ok for ok, _ in outcomes] == [False, False, False, False, True]
    for _, error in outcomes[:4]:
        assert isinstance(error, ValueError) and "non-finite float" in str(error), error
        assert "app.score returned" in str(error) and "return finite numbers" in str(error)


def test_a_huge_unstorable_output_is_named_in_a_bounded_message() -> None:
    [(ok, error)] = storable("app.big", [(True, {"seen": set(range(100_000))})])
    assert not ok and "app.big returned dict" in str(error) and len(str(error)) < 600


def test_a_numpy_row_shows_in_flower_as_the_msgpack_reader_gets_it() -> None:
    row = np.arange(384, dtype=np.float32) / 384
    assert short_repr(row, serializer="msgpack") == _repr_of_head(row.tolist())  # 0.0026041667... widened
    assert short_repr(row, serializer="msgpack") != short_repr(row)
    assert short_repr(np.array([0.5, np.nan], dtype=np.float32), serializer="msgpack") == "[0.5, None]"


def _stored(entries: list[tuple[str, str, Any]]) -> list[tuple[str, bytes]]:
    """(task id, encoded meta) as the worker's store would write each of ``entries``."""
    writes = app.backend.store_args(entries)
    return [(task_id, meta) for (task_id, _, _), meta in zip(entries, writes.payloads, strict=True)]


class _NoRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize("serializer", ["msgpack", "json"])
def test_a_model_output_the_serializer_cannot_store_becomes_that_requests_failure(
    serializer: Literal["json", "msgpack"],
) -> None:
    """A model's outputs are not checked before the store (per the protocol they are storable); one
    that is not fails its own request, in ``entries`` too, and the batch's others are stored."""
    import uuid

    from carpool.errors import ModelError

    backend = create_app(Settings(result_serializer=serializer)).backend
    row = np.arange(4, dtype=np.float32)
    tagged = {"id": uuid.uuid4()}  # Celery's JSON tags a UUID; msgpack has no form for it
    # A set has no form in either, nor an object whose repr raises; under msgpack a UUID and a
    # non-string key have none a reader takes, while Celery's JSON would store them (named then).
    odd: list[Any] = [{"seen": {1, 2}}, _NoRepr()]
    json_takes = [False, False]
    if serializer == "msgpack":
        odd += [tagged, {"nested": {1: 2}}]
        json_takes += [True, True]
    entries: list[tuple[str, str, Any]] = [("t0", SUCCESS, row)]
    entries += [(f"odd{i}", SUCCESS, v) for i, v in enumerate(odd)]
    entries.append(("t1", SUCCESS, [1.5, "x"]))
    if serializer == "json":
        entries.append(("t2", SUCCESS, tagged))
    metas = [backend.decode_result(p) for p in backend.store_args(entries).payloads]
    refused = slice(1, 1 + len(odd))
    assert [m["status"] for m in metas] == [SUCCESS] + [FAILURE] * len(odd) + [SUCCESS] * (
        len(entries) - 1 - len(odd)
    )
    assert metas[0]["result"] == row.tolist() and metas[1 + len(odd)]["result"] == [1.5, "x"]
    if serializer == "json":
        assert metas[-1]["result"] == tagged, "a UUID, as a plain Celery worker's result reads"
    for (_, state, error), meta, named in zip(entries[refused], metas[refused], json_takes, strict=True):
        assert state == FAILURE and isinstance(error, ModelError), "the caller's entries say it too"
        text = str(backend.exception_to_python(meta["result"]))
        assert f"cannot be stored as {serializer}" in text and "numpy array with one row per request" in text
        assert ("CARPOOL_RESULT_SERIALIZER=json" in text) == named
    assert entries[0][1] == entries[1 + len(odd)][1] == SUCCESS


@given(
    f32_batches
    | hnp.arrays(
        np.float64, st.integers(1, 70_000), elements=st.floats(allow_nan=False, allow_infinity=False)
    )
)
def test_a_stored_row_reads_into_an_array_of_the_values_get_returns(row: np.ndarray) -> None:
    """``success_row`` (gather's as_array) reads a model's row from the stored meta's bytes: the same
    values kombu's reader gives as floats, in the row's own dtype, and the rest of the meta alike."""
    for one in row if row.ndim == 2 else [row]:
        stored = app.backend.meta_for("row-task", SUCCESS, one, "2026-12-04T00:00:00")
        read = success_row(stored)
        assert read is not None
        assert read["result"].dtype == one.dtype and read["result"].dtype.isnative
        assert read["result"].flags.c_contiguous and read["result"].flags.writeable
        plain_meta = app.backend.decode_result(stored)
        assert [v.hex() for v in read["result"].tolist()] == [v.hex() for v in plain_meta["result"]]
        assert {k: v for k, v in read.items() if k != "result"} == {
            k: v for k, v in plain_meta.items() if k != "result"
        }


@pytest.mark.parametrize(
    "result",
    [
        [1, 2, 3],  # integers
        [1.5, 2],  # a float and an integer
        [[1.0, 2.0], [3.0, 4.0]],  # nested
        [],
        "text",
        None,
        {"vector": [1.0]},
        np.array([1.5, np.nan], dtype=np.float32),  # non-finite: stored as the values JSON gives
    ],
)
def test_any_other_success_is_left_to_the_usual_decoding(result: Any) -> None:
    stored = app.backend.meta_for("other-task", SUCCESS, result, "2026-12-04T00:00:00")
    assert success_row(stored) is None


def test_failures_json_metas_and_damaged_rows_are_left_to_the_usual_decoding() -> None:
    row = np.arange(1, 40, dtype=np.float32)
    assert success_row(app.backend.meta_for("failed", FAILURE, ValueError("no"))) is None
    assert success_row(json_app.backend.meta_for("as-json", SUCCESS, row, "2026-12-04T00:00:00")) is None
    stored = app.backend.meta_for("cut", SUCCESS, row, "2026-12-04T00:00:00")
    assert success_row(stored) is not None
    for damaged in (stored[:40], stored[:-3], stored.replace(b"\xca", b"\xcb", 1), stored[:-1] + b"\xc1"):
        assert success_row(damaged) is None
    # A writer other than carpool's repeating "result" after the row: kombu's reader takes the last.
    repeated = stored[:-12] + msgpack.packb("result") + msgpack.packb("other")  # for "task_id": "cut"
    assert msgpack.unpackb(repeated)["result"] == "other" and success_row(repeated) is None


def test_a_result_holding_a_uuid_is_left_to_celerys_json_which_tags_it() -> None:
    """orjson writes a UUID as its text; Celery's JSON tags it, and a reader gets the UUID back."""
    import uuid

    from carpool.codec import dumps_result

    assert dumps_result({"id": uuid.UUID(int=7), "n": [1.5]}) is None
    assert dumps_result([[uuid.UUID(int=7)]]) is None
    text = str(uuid.UUID(int=7))  # the same text, as a str: plain JSON, written as it is
    assert dumps_result({"id": text}) == b'{"id":"' + text.encode() + b'"}'
    assert dumps_result([0.5, -1.0]) == b"[0.5,-1.0]"


def _raised_with_a_lone_surrogate() -> ValueError:
    name = b"/data/caf\xe9.jpg".decode("utf-8", "surrogateescape")  # as os.listdir() names it
    try:
        raise ValueError(f"cannot decode image {name}")
    except ValueError as exc:
        return exc


@pytest.mark.parametrize("serializer", ["json", "msgpack"])
def test_a_raised_failure_with_a_lone_surrogate_is_stored_with_its_traceback_escaped(serializer: str) -> None:
    """The traceback's text held the surrogate as is, which msgpack refused: the batch's store failed."""
    from carpool.celery_edge.app import app

    app.conf.result_serializer = serializer
    try:
        backend = app.backend.__class__(app=app, url=app.conf.result_backend)
        exc = _raised_with_a_lone_surrogate()
        writes = backend.store_args([("bad", "FAILURE", exc), ("good", "SUCCESS", "fine")])
        bad, good = (backend.decode(p) for p in writes.payloads)
    finally:
        app.conf.result_serializer = "msgpack"
    assert bad["status"] == "FAILURE" and bad["result"]["exc_type"] == "ValueError"
    assert "caf\\udce9.jpg" in bad["traceback"] and "raise ValueError" in bad["traceback"]
    assert good["status"] == "SUCCESS" and good["result"] == "fine"


@pytest.mark.parametrize("argument", [{1: "a"}, {("k", 2): "tuple key"}, [{"nested": {3: "deep"}}]])
def test_a_failure_whose_arguments_hold_a_key_no_msgpack_reader_takes_is_stored_as_a_model_error(
    argument: Any,
) -> None:
    """msgpack packed ``ValueError({1: 'a'})`` without a word, and every reader refused it: the
    caller's .get() and .state raised DecodeError (found by the review of users' functions)."""
    from carpool.celery_edge.app import app
    from carpool.errors import ModelError

    backend = app.backend.__class__(app=app, url=app.conf.result_backend)
    entries: list[tuple[str, str, Any]] = [("odd", "FAILURE", ValueError(argument)), ("good", "SUCCESS", 2)]
    odd, good = (backend.decode(p) for p in backend.store_args(entries).payloads)
    assert odd["status"] == "FAILURE" and odd["result"]["exc_type"] == "ModelError"
    assert "ValueError: " in str(odd["result"]["exc_message"])
    assert isinstance(entries[0][2], ModelError) and good["result"] == 2


def test_a_failure_that_cannot_be_stored_as_raised_fails_alone_as_a_model_error() -> None:
    from carpool.celery_edge.app import app

    class Unstorable(Exception):
        pass

    backend = app.backend.__class__(app=app, url=app.conf.result_backend)
    original = backend.encode_result

    def refusing(result: Any, state: str) -> Any:
        if isinstance(result, Unstorable):
            raise TypeError("not encodable")
        return original(result, state)

    backend.encode_result = refusing
    entries: list[tuple[str, str, Any]] = [("odd", "FAILURE", Unstorable("x")), ("good", "SUCCESS", 1.5)]
    odd, good = (backend.decode(p) for p in backend.store_args(entries).payloads)
    assert odd["status"] == "FAILURE" and odd["result"]["exc_type"] == "ModelError"
    assert "Unstorable: x" in str(odd["result"]["exc_message"])
    assert entries[0][2].__class__.__name__ == "ModelError"  # what events and links see agrees
    assert good["result"] == 1.5


@pytest.mark.parametrize("serializer_app", [app, json_app], ids=["msgpack", "json"])
@pytest.mark.parametrize(
    ("state", "result"),
    [(SUCCESS, [0.5, 1.5]), (SUCCESS, np.ones(3, dtype=np.float32)), (FAILURE, ValueError("no"))],
)
def test_a_stored_answer_lists_no_children_as_a_celery_worker_stores_it(
    serializer_app: Any, state: str, result: Any
) -> None:
    """A Celery worker stores ``children: []`` for a task that started none; ``None`` would make
    ``AsyncResult.children`` something a caller cannot iterate."""
    stored = serializer_app.backend.meta_for("kids", state, result, "2026-12-05T00:00:00")
    meta = serializer_app.backend.decode_result(stored)
    assert meta["children"] == []
    answered = serializer_app.AsyncResult("kids")
    answered._maybe_set_cache(meta)
    assert answered.children == []
    assert list(answered.children) == []
