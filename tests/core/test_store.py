"""The measurement store: typed records, one key function, a schema version; anything it cannot
trust reads as None (measured again)."""

from __future__ import annotations

import json

import pytest

from selfspec.core import store
from selfspec.core.cost import CostProfile

from ..conftest import tiny_model


@pytest.mark.parametrize("rec", [store.DraftRatio(0.4), store.SelfTestPass(1e-5),
                                 store.KernelsChoice("onednn", {"stock": 0.2, "onednn": 0.1}),
                                 CostProfile((1, 2), (0.01, 0.02), 64, "k", (0.01, 0.02), (0.0, 0.0), 3)])
def test_every_kind_round_trips_and_nothing_else_is_trusted(rec, tmp_path):
    key = store.key(rec.KIND, tiny_model(), "tiny", "stock", "x")
    where = store.write(key, rec, "test record")
    assert where is not None and where == store.path(key)
    assert store.read(key, type(rec)) == rec
    good = json.loads(where.read_text())
    assert good["schema"] == store.SCHEMA and good["kind"] == rec.KIND.value and good["key"] == key
    other = store.DraftRatio if not isinstance(rec, store.DraftRatio) else store.SelfTestPass
    assert store.read(key, other) is None  # a record of another kind under the same key
    for bad in ("{oops", "[]", json.dumps(good["data"]), json.dumps({**good, "schema": store.SCHEMA + 1}),
                json.dumps({**good, "key": key + "|other"}), json.dumps({**good, "data": {}})):
        where.write_text(bad)
        assert store.read(key, type(rec)) is None
    assert store.read(key + "|missing", type(rec)) is None


def test_one_key_function_separates_kinds_backends_and_details():
    m = tiny_model()
    keys = {store.key(k, m, "tiny", b, *d) for k in store.Kind for b in ("stock", "onednn") for d in ((), ("a",))}
    assert len(keys) == len(store.Kind) * 4
    assert store.key(store.Kind.DRAFT_RATIO, m, "tiny", "stock", 1) == store.key(store.Kind.DRAFT_RATIO, m, "tiny",
                                                                                 "stock", 1)
    assert all(k.split("|")[0] in {x.value for x in store.Kind} for k in keys)


def test_a_draft_ratio_must_be_positive():
    with pytest.raises(ValueError):
        store.DraftRatio.from_json({"ratio": 0})
