"""The collection's error modes (sparsekit.step_errors): "raise" reads each step's verdict
once, before any table changes; "late" reads nothing where the step needs no host decision
(direct tables, eval) and raises a recorded error at a later forward or check_errors();
"assert" makes the verdict a device assert. Host reads are counted with the GPU branches
taken on the CPU, as in test_collection_syncs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st
from properties import examples

import sparsekit as sk
from sparsekit._device import emulate_device
from test_collection_fused import _loss
from test_collection_syncs import _reads, _steady


@pytest.mark.parametrize("error_mode", ["late", "assert"])
@pytest.mark.parametrize("optimizer", ["sgd", "lazy_adam", "rowwise_adagrad"])
def test_a_steady_fused_step_of_direct_tables_reads_nothing(error_mode, optimizer):
    for num_tables in (2, 26):
        ebc, batch = _steady(num_tables, False, optimizer, error_mode)
        reads = _reads(lambda: _loss(ebc(batch)).backward())
        assert sum(reads.values()) == 0, (num_tables, reads)


def test_an_eval_forward_of_hash_tables_reads_nothing_late():
    ebc, batch = _steady(26, True, "sgd", "late")
    ebc.eval()
    with torch.no_grad():
        reads = _reads(lambda: ebc(batch))
    assert sum(reads.values()) == 0, reads


def test_a_training_step_of_hash_tables_still_reads_once_late():
    # Its tables may grow: the one read decides that, and carries the verdict with it.
    ebc, batch = _steady(3, True, "sgd", "late")
    reads = _reads(lambda: _loss(ebc(batch)).backward())
    assert sum(reads.values()) == 1, reads


def _state(ebc):
    return [t.clone() for t in ebc.state_dict().values() if isinstance(t, torch.Tensor)]


@examples(10)
@given(hashed=st.booleans(), optimizer=st.sampled_from(["sgd", "lazy_adam", "rowwise_adagrad"]),
       emulated=st.booleans(), steps=st.integers(1, 4), seed=st.integers(0, 2 ** 16))
def test_on_valid_input_every_mode_trains_as_raise_does(hashed, optimizer, emulated, steps, seed):
    runs = {}
    for mode in ("raise", "late", "assert"):
        ebc, _ = _steady(3, hashed, optimizer, mode)
        g = torch.Generator().manual_seed(seed)
        outs = []
        for _ in range(steps):
            lengths = torch.randint(0, 4, (3 * 8,), generator=g)
            kjt = sk.KeyedJagged(["f0", "f1", "f2"], torch.randint(0, 12, (int(lengths.sum()),), generator=g),
                                 lengths=lengths)
            if emulated:
                with emulate_device():
                    out = ebc(kjt)
                    _loss(out).backward()
            else:
                out = ebc(kjt)
                _loss(out).backward()
            outs.append(torch.cat(list(out.values()), 1).detach())
        ebc.check_errors()
        runs[mode] = (outs, _state(ebc))
    for mode in ("late", "assert"):
        assert all(torch.equal(a, b) for a, b in zip(runs["raise"][0], runs[mode][0])), mode
        assert all(torch.equal(a, b) for a, b in zip(runs["raise"][1], runs[mode][1])), mode


_BAD_OFFSETS = sk.KeyedJagged(["f0", "f1", "f2"], torch.tensor([1, 2, 3, 4]), offsets=torch.tensor([0, 3, 1, 4]))


@pytest.mark.parametrize("emulated", [False, True])
def test_late_bad_offsets_raise_at_the_next_forward_once(emulated):
    ebc, batch = _steady(3, False, "sgd", "late")

    def run(kjt):
        if emulated:
            with emulate_device():
                return ebc(kjt)
        return ebc(kjt)

    run(_BAD_OFFSETS)  # no read: recorded on the device
    with pytest.raises(ValueError, match="offsets must start at 0.*met by an earlier step, error_mode='late'"):
        run(batch)
    _loss(run(batch)).backward()  # raised once: the record is empty again
    ebc.check_errors()


def test_late_errors_raise_at_check_errors():
    ebc, batch = _steady(3, False, "sgd", "late")
    ebc.eval()
    ebc(_BAD_OFFSETS)
    with pytest.raises(ValueError, match="offsets must start at 0"):
        ebc.check_errors()
    ebc.check_errors()  # once
    ebc(batch)


@pytest.mark.parametrize("emulated", [False, True])
def test_a_late_key_outside_a_direct_table_names_its_table_and_key_and_updates_only_good_rows(emulated):
    ebc, _ = _steady(3, False, "sgd", "late")
    before = [w.detach().clone() for w in ebc.weights.values()]
    bad = sk.KeyedJagged(["f0", "f1", "f2"], torch.tensor([1, 2, 5000, 3]), lengths=torch.tensor([1, 1, 2]))
    with emulate_device() if emulated else torch.enable_grad():
        _loss(ebc(bad)).backward()
    after = [w.detach() for w in ebc.weights.values()]
    # The good lookups trained; the bad one read zeros and updated nothing.
    assert not torch.equal(before[0][1], after[0][1]) and not torch.equal(before[2][3], after[2][3])
    changed = [int((a != b).any(1).sum()) for a, b in zip(before, after)]
    assert changed == [1, 1, 1], changed
    with pytest.raises(ValueError, match=r"key 5000 of table 't2' is out of range.*error_mode='late'"):
        ebc.check_errors()


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("key", [-1, 10, 2 ** 40])
def test_a_late_key_outside_a_direct_table_is_left_out_of_an_unfused_backward(key, create_graph):
    # The keys of direct tables are read as rows: one outside its table must be left out of
    # the sparse gradient, the per-sample weights' gradient and a create_graph backward,
    # neither indexed nor raised there (the error word holds it).
    ebc = sk.EmbeddingBagCollection([sk.TableConfig("t0", 4, 10, ["f0"], use_hashtable=False)], error_mode="late",
                                    is_weighted=True)
    weights = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    kjt = sk.KeyedJagged(["f0"], torch.tensor([1, key, 2]), lengths=torch.tensor([2, 1]), weights=weights)
    out = ebc(kjt)["f0"]
    grads = torch.autograd.grad(out.square().sum(), [weights, ebc.weights["t0"]], create_graph=create_graph)
    good = ebc.weights["t0"].detach()
    want = torch.tensor([2 * float(good[1] @ out[0].detach()), 0.0, 2 * float(good[2] @ out[1].detach())])
    torch.testing.assert_close(grads[0].detach(), want)
    assert set(grads[1].coalesce().indices()[0].tolist()) == {1, 2}
    with pytest.raises(ValueError, match=rf"key {key} of table 't0' is out of range"):
        ebc.check_errors()


def test_assert_mode_fails_the_step_on_the_cpu_at_once():
    ebc, _ = _steady(3, False, "sgd", "assert")
    with pytest.raises(RuntimeError, match="error_mode='assert'"):
        ebc(_BAD_OFFSETS)


def test_an_error_word_entry_raises_at_check_errors_in_every_mode():
    for mode in ("raise", "late"):
        ebc, batch = _steady(2, True, "sgd", mode)
        ebc._step_errors.slots(torch.device("cpu"))[0] = 3
        with pytest.raises(RuntimeError, match="pooled read or fused update met bad input"):
            ebc.check_errors()
        ebc.check_errors()


def test_error_mode_is_checked_by_name():
    with pytest.raises(ValueError, match="error_mode must be one of 'raise', 'late', 'assert', got 'never'"):
        sk.EmbeddingBagCollection([sk.TableConfig("t", 4, 8, ["f"])], error_mode="never")


def test_a_copy_starts_with_no_recorded_error():
    import copy
    import pickle
    ebc, batch = _steady(3, False, "sgd", "late")
    ebc(_BAD_OFFSETS)
    for other in (copy.deepcopy(ebc), pickle.loads(pickle.dumps(ebc))):
        assert other._step_errors.mode == "late"
        other.check_errors()
    with pytest.raises(ValueError):
        ebc.check_errors()


# ---- the op: sparsekit::record_verdict_ ----

_NONE = 2 ** 63 - 1


def _fold_reference(record, errors, flags, report, bounds, keys, feature_tables):
    """record_verdict_ in plain Python: the verdict, kept if the record is clean."""
    nnz = len(keys)
    at = report[0]
    table = key = 0
    if 0 <= at < nnz and feature_tables:
        feature = max(f for f in range(len(feature_tables)) if bounds[f] <= at)
        table, key = feature_tables[feature], keys[at]
    verdict = [flags, report[0], report[1], report[2], errors[0], errors[1], table, key, nnz]

    def clean(v):
        return v[0] == 0 and v[1] >= v[8] and v[3] == 0 and v[4] == _NONE and v[5] == _NONE

    if clean(record) and not clean(verdict):
        record = verdict
    return record, [_NONE, _NONE], clean(record)


@examples(60)
@given(data=st.data())
def test_record_verdict_matches_plain_python(data):
    lengths = data.draw(st.lists(st.integers(0, 5), max_size=6))
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    nnz = bounds[-1]
    keys = data.draw(st.lists(st.integers(-2 ** 63, 2 ** 63 - 1), min_size=nnz, max_size=nnz))
    feature_tables = data.draw(st.lists(st.integers(0, 30), min_size=len(lengths), max_size=len(lengths)))
    at = data.draw(st.sampled_from([nnz] + list(range(nnz))))
    report = [at, data.draw(st.integers(0, 9)), data.draw(st.sampled_from([0, 0, 1]))]
    flags = data.draw(st.sampled_from([0, 0, 2]))
    errors = [data.draw(st.sampled_from([_NONE, _NONE, 0, 7])) for _ in range(2)]
    record = data.draw(st.sampled_from([[0, 0, 0, 0, _NONE, _NONE, 0, 0, 0], [2, 3, 0, 0, _NONE, _NONE, 0, 0, 3],
                                        [0, 1, 0, 0, _NONE, _NONE, 4, 99, 5]]))
    want_record, want_errors, want_clean = _fold_reference(record, errors, flags, report, bounds, keys,
                                                           feature_tables)
    record_t, errors_t = torch.tensor(record), torch.tensor(errors)
    bounds_t = torch.tensor(bounds)
    if data.draw(st.booleans()) and len(bounds) > 1:  # a strided view, as offsets[::B] is
        bounds_t = torch.stack([bounds_t, bounds_t], 1).reshape(-1)[::2]
    clean = torch.zeros(1, dtype=torch.bool)
    torch.ops.sparsekit.record_verdict_(record_t, errors_t, clean, torch.tensor(flags), torch.tensor(report),
                                        bounds_t, torch.tensor(keys, dtype=torch.int64),
                                        torch.tensor(feature_tables, dtype=torch.int64))
    assert record_t.tolist() == want_record and errors_t.tolist() == want_errors and bool(clean) == want_clean


@pytest.mark.parametrize("argument, bad, match", [
    ("record", torch.zeros(8, dtype=torch.int64), "record must be a contiguous int64 tensor \\[9\\]"),
    ("errors", torch.zeros(3, dtype=torch.int64), "errors must be a contiguous int64 tensor \\[2\\]"),
    ("clean", torch.zeros(1, dtype=torch.int64), "clean must be one bool"),
    ("flags", torch.zeros(2, dtype=torch.int64), "flags must be one int64"),
    ("report", torch.zeros(2, dtype=torch.int64), "report must be lookup_rows' contiguous int64 \\[3\\]"),
    ("bounds", torch.zeros(5, dtype=torch.int64), "bounds must be a 1-D int64 tensor of 3 entries"),
    ("keys", torch.zeros(4, dtype=torch.int32), "keys must be a 1-D int64 tensor"),
    ("feature_tables", torch.zeros(2, dtype=torch.int32), "feature_tables must be a 1-D int64 tensor"),
])
def test_record_verdict_names_a_bad_argument_and_changes_nothing(argument, bad, match):
    args = {"record": torch.zeros(9, dtype=torch.int64), "errors": torch.full((2,), _NONE),
            "clean": torch.ones(1, dtype=torch.bool), "flags": torch.tensor(2), "report": torch.tensor([4, 0, 0]), "bounds": torch.tensor([0, 2, 4]),
            "keys": torch.arange(4), "feature_tables": torch.tensor([0, 1])}
    args[argument] = bad
    record, errors, clean = args["record"].clone(), args["errors"].clone(), args["clean"].clone()
    with pytest.raises(RuntimeError, match=f"record_verdict_: {match}"):
        torch.ops.sparsekit.record_verdict_(*args.values())
    assert torch.equal(args["record"], record) and torch.equal(args["errors"], errors)
    assert torch.equal(args["clean"], clean)


def test_record_verdict_opcheck():
    from torch.library import opcheck
    opcheck(torch.ops.sparsekit.record_verdict_.default,
            (torch.zeros(9, dtype=torch.int64), torch.full((2,), _NONE), torch.zeros(1, dtype=torch.bool), torch.tensor(0), torch.tensor([1, 0, 0]),
             torch.tensor([0, 1, 3]), torch.tensor([5, 6, 7]), torch.tensor([0, 1])))
