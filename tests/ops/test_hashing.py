"""sparsekit.hashing: per-slot salted XXH3-64 feature hashing."""

import array
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash

import sparsekit as sk
from sparsekit import hashing

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# Pinned digests: a change of the hashing scheme silently remaps every trained
# embedding, so it must show up as a failing test.
GOLDEN = [
    (("68fd1e64", 0, 0), -3266986836811480530),
    ((b"68fd1e64", 5, 0), -2022502926872678256),
    ((0, 0, 0), -766854857554912791),
    ((-1, 3, 0), 7181711583969079835),
    ((INT64_MAX, 0, 0), -1357985031239963096),
    ((INT64_MIN, 0, 0), 946921554348743494),
    (("", 0, 0), 6865193794209239025),
    (("abc", 0, 7), -490123084197498011),
]


def test_exported_as_sk_hashing():
    assert sk.hashing is hashing


@pytest.mark.parametrize("args,expected", GOLDEN)
def test_golden_values(args, expected):
    value, slot, seed = args
    assert hashing.hash_value(value, slot, seed=seed) == expected


def test_deterministic_across_processes():
    # A fresh interpreter with a different PYTHONHASHSEED gives the same keys.
    code = ("import torch; from sparsekit import hashing; "
            "print(hashing.hash_values(['a', b'b', 3, -1], 4, seed=9).tolist())")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert eval(out) == hashing.hash_values(["a", b"b", 3, -1], 4, seed=9).tolist()


def test_salted_per_slot():
    for value in ("68fd1e64", b"\x00", 0, -1, ""):
        keys = {hashing.hash_value(value, slot) for slot in range(64)}
        assert len(keys) == 64
    assert hashing.slot_seed(0) != hashing.slot_seed(1)
    # The slot seed really is the XXH3 seed of the slot's text values.
    assert hashing.hash_value(b"xyz", 3) == hashing.hash_value(b"xyz", 3)
    digest = xxhash.xxh3_64_intdigest(b"xyz", hashing.slot_seed(3))
    assert hashing.hash_value(b"xyz", 3) == (digest - (1 << 64) if digest >= 1 << 63 else digest)


def test_seed_changes_keys():
    assert hashing.hash_value("abc", 2, seed=0) != hashing.hash_value("abc", 2, seed=1)
    assert hashing.slot_seed(2, 0) != hashing.slot_seed(2, 1)


def test_str_is_utf8_bytes_and_int_is_its_own_kind():
    assert hashing.hash_value("héllo", 1) == hashing.hash_value("héllo".encode("utf-8"), 1)
    assert hashing.hash_value(bytearray(b"ab"), 1) == hashing.hash_value(b"ab", 1)
    assert hashing.hash_value(memoryview(b"ab"), 1) == hashing.hash_value(b"ab", 1)
    assert hashing.hash_value(7, 0) != hashing.hash_value((7).to_bytes(8, "little"), 0)
    assert hashing.hash_value(7, 0) != hashing.hash_value("7", 0)
    assert hashing.hash_value(np.int32(7), 0) == hashing.hash_value(7, 0)
    assert hashing.hash_value(np.uint8(7), 0) == hashing.hash_value(7, 0)


@pytest.mark.parametrize("value", [INT64_MIN, INT64_MAX, -1, 0])
def test_adversarial_ints_are_valid(value):
    key = hashing.hash_value(value, 0)
    assert INT64_MIN <= key <= INT64_MAX


def test_bad_values_raise():
    with pytest.raises(OverflowError, match="int64"):
        hashing.hash_value(1 << 63)
    with pytest.raises(OverflowError, match="int64"):
        hashing.hash_value(INT64_MIN - 1)
    with pytest.raises(TypeError, match="float"):
        hashing.hash_value(1.5)
    with pytest.raises(TypeError, match="NoneType"):
        hashing.hash_value(None)
    with pytest.raises(TypeError, match="dtype"):
        hashing.hash_values(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="dtype"):
        hashing.hash_values(np.array([1.0]))
    # One string is not a list of values (it would be hashed character by character).
    for one in ("abc", b"abc"):
        with pytest.raises(TypeError, match="hash_values: values must be a sequence"):
            hashing.hash_values(one)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(slot=1.5), TypeError, "slot must be an int, got 1.5"),
    (dict(slot=None), TypeError, "slot must be an int, got None"),
    (dict(slot=True), TypeError, "slot must be an int, got True"),
    (dict(slot=2**63), ValueError, "slot must be in the int64 range"),
    (dict(slot=-2**63 - 1), ValueError, "slot must be in the int64 range"),
    (dict(seed=1.5), TypeError, "seed must be an int, got 1.5"),
    (dict(seed=False), TypeError, "seed must be an int, got False"),
])
def test_bad_slot_or_seed_raise_naming_it(kwargs, error, message):
    for call in (lambda: hashing.hash_value("a", **kwargs), lambda: hashing.hash_value(7, **kwargs),
                 lambda: hashing.hash_values(["a"], **kwargs), lambda: hashing.slot_seed(**{"slot": 0, **kwargs})):
        with pytest.raises(error, match=message):
            call()


def test_slot_and_seed_take_any_integer_type():
    assert hashing.hash_value("a", np.int32(3), seed=np.uint64(5)) == hashing.hash_value("a", 3, seed=5)
    # Seeds are taken modulo 2**64, slots anywhere in the int64 range.
    assert hashing.hash_value("a", seed=-1) == hashing.hash_value("a", seed=2**64 - 1)
    assert hashing.hash_value("a", slot=-2**63) != hashing.hash_value("a", slot=2**63 - 1)


def test_hash_values_matches_hash_value():
    values = ["a", b"a", 1, -1, INT64_MIN, "", "68fd1e64"]
    keys = hashing.hash_values(values, 5, seed=3)
    assert keys.dtype == torch.int64 and keys.shape == (len(values),)
    assert keys.tolist() == [hashing.hash_value(v, 5, seed=3) for v in values]
    ints = [3, -7, INT64_MAX]
    expected = [hashing.hash_value(v, 2) for v in ints]
    assert hashing.hash_values(torch.tensor(ints), 2).tolist() == expected
    assert hashing.hash_values(np.array(ints, dtype=np.int64), 2).tolist() == expected
    empty = hashing.hash_values([], 0)
    assert empty.dtype == torch.int64 and empty.shape == (0,)


def test_hash_rows_salts_each_column_by_slot():
    rows = [["x", "x", 1], [b"y", "x", 2]]
    keys = hashing.hash_rows(rows, seed=4, first_slot=10)
    assert keys.shape == (2, 3) and keys.dtype == torch.int64
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            assert keys[i, j].item() == hashing.hash_value(value, 10 + j, seed=4)
    assert keys[0, 0] != keys[0, 1]  # same string, different slots
    assert hashing.hash_rows([]).shape == (0, 0)
    with pytest.raises(ValueError, match="row 1 has 1 values"):
        hashing.hash_rows([["a", "b"], ["a"]])


def test_no_collisions_among_many_distinct_values():
    values = [f"{i:08x}" for i in range(50_000)]
    keys = hashing.hash_values(values, 0)
    assert torch.unique(keys).numel() == len(values)


@pytest.mark.parametrize("value", [True, False, np.True_, np.bool_(False), torch.tensor(True)])
def test_bools_are_refused_as_values(value):
    """True is an int to Python, but a flag hashed as 1 would share the integer 1's key: every
    kind of bool is refused, as it is for slot and seed, with the explicit conversion to use."""
    with pytest.raises(TypeError, match=r"sparsekit.hashing.hash_value: cannot hash a bool .*convert it to int explicitly"):
        hashing.hash_value(value)
    with pytest.raises(TypeError, match=r"hash_values: values\[1\]: cannot hash a bool"):
        hashing.hash_values([1, value])
    with pytest.raises(TypeError, match=r"hash_rows: rows\[0\]\[1\]: cannot hash a bool"):
        hashing.hash_rows([["a", value]])
    assert hashing.hash_value(int(value)) == hashing.hash_value(int(bool(value)))


def test_bool_arrays_and_tensors_are_refused():
    with pytest.raises(TypeError, match=r"hash_values: array of dtype bool; .*convert bools to int explicitly"):
        hashing.hash_values(np.array([True, False]))
    with pytest.raises(TypeError, match=r"hash_values: tensor of dtype torch.bool; .*convert bools to int explicitly"):
        hashing.hash_values(torch.tensor([True, False]))
    with pytest.raises(TypeError, match="cannot hash a bool"):
        hashing.hash_values(np.array([1, True], dtype=object))
    assert hashing.hash_values(torch.tensor([True, False]).long()).tolist() == [hashing.hash_value(1),
                                                                                hashing.hash_value(0)]


@pytest.mark.parametrize("slot", [np.True_, torch.tensor(False)])
def test_numpy_and_tensor_bools_are_refused_as_slot_or_seed(slot):
    with pytest.raises(TypeError, match="slot must be an int, got .*convert a bool with int"):
        hashing.hash_value("a", slot)
    with pytest.raises(TypeError, match="seed must be an int, got .*convert a bool with int"):
        hashing.hash_value("a", 0, seed=slot)


def test_hash_rows_refuses_a_row_that_is_one_string():
    """A str row would be read as a row of characters (["abc", "def"] -> shape [2, 3])."""
    for rows, index, kind in ((["abc", "def"], 0, "str"), ([["a"], b"b"], 1, "bytes"), ([[1], bytearray(b"x")], 1,
                                                                                          "bytearray")):
        with pytest.raises(TypeError, match=rf"hash_rows: row {index} is one {kind} .*pass \["):
            hashing.hash_rows(rows)
    with pytest.raises(TypeError, match="hash_rows: rows must be a sequence of rows, got one str"):
        hashing.hash_rows("abc")
    assert hashing.hash_rows([["abc"], ["def"]]).tolist() == [[hashing.hash_value("abc")], [hashing.hash_value("def")]]


@pytest.mark.parametrize("value", ["\ud800", "ab\udfffcd", "x" * 100 + "\ud83d"])
def test_lone_surrogate_raises_value_error_naming_the_value(value):
    """str is hashed as its UTF-8 bytes, and a lone surrogate has none: a ValueError naming
    sparsekit.hashing and the value, not a bare UnicodeEncodeError from inside."""
    with pytest.raises(ValueError, match=r"sparsekit.hashing.hash_value: cannot hash '.*': .* lone surrogate") as info:
        hashing.hash_value(value)
    assert not isinstance(info.value, UnicodeError)
    assert repr(value[:20])[1:-1] in str(info.value)
    with pytest.raises(ValueError, match="lone surrogate"):
        hashing.hash_values(["ok", value])
    # A well-formed pair is fine.
    assert hashing.hash_value("\ud83d\ude00".encode("utf-16", "surrogatepass").decode("utf-16")) == \
        hashing.hash_value("\U0001F600".encode("utf-8"))


def test_hash_values_takes_numpy_string_and_object_arrays():
    """Arrays of str ('U'), bytes ('S') and objects are hashed element by element, exactly as
    hash_value hashes each element (they were refused with "pass integers, strings or bytes")."""
    text = np.array(["a", "héllo", ""])
    assert hashing.hash_values(text, 3, seed=2).tolist() == [hashing.hash_value(v, 3, seed=2) for v in
                                                            ["a", "héllo", ""]]
    raw = np.array([b"a", b"\x00b"])
    assert hashing.hash_values(raw, 1).tolist() == [hashing.hash_value(b"a", 1), hashing.hash_value(b"\x00b", 1)]
    mixed = np.array(["a", b"a", 7, np.int32(-1)], dtype=object)
    assert hashing.hash_values(mixed).tolist() == [hashing.hash_value(v) for v in ["a", b"a", 7, -1]]
    grid = np.array([["a", "b"], ["c", "d"]])  # read flattened
    assert hashing.hash_values(grid).tolist() == hashing.hash_values(["a", "b", "c", "d"]).tolist()
    with pytest.raises(TypeError, match="NoneType"):
        hashing.hash_values(np.array(["a", None], dtype=object))


@pytest.mark.parametrize("first_slot", [True, False, np.True_, np.bool_(False), torch.tensor(True)])
def test_hash_rows_refuses_a_bool_first_slot(first_slot):
    """A bool first_slot was hashed as slot 1 (or 0); bools are refused as slots, naming first_slot."""
    for rows in ([["a"]], []):  # checked even when there is nothing to hash
        with pytest.raises(TypeError, match=r"hash_rows: first_slot must be an int, got .*convert a bool with int"):
            hashing.hash_rows(rows, first_slot=first_slot)


def test_hash_rows_names_first_slot_in_its_errors():
    for bad in (1.0, None, "1"):
        with pytest.raises(TypeError, match=r"hash_rows: first_slot must be an int, got "):
            hashing.hash_rows([["a"]], first_slot=bad)
    with pytest.raises(TypeError, match=r"hash_rows: seed must be an int, got True"):
        hashing.hash_rows([], seed=True)
    with pytest.raises(ValueError, match=r"hash_rows: first_slot must be in the int64 range"):
        hashing.hash_rows([["a"]], first_slot=INT64_MAX + 1)
    with pytest.raises(ValueError, match=r"hash_rows: first_slot \+ 1 .* must be in the int64 range"):
        hashing.hash_rows([["a", "b"]], first_slot=INT64_MAX)
    assert hashing.hash_rows([["a"]], first_slot=INT64_MAX).tolist() == [[hashing.hash_value("a", INT64_MAX)]]
    assert hashing.hash_rows([["a", 1]], first_slot=np.int32(2), seed=np.uint64(3)).tolist() == \
        hashing.hash_rows([["a", 1]], first_slot=2, seed=3).tolist()


def test_hash_values_checks_slot_and_seed_with_no_values():
    with pytest.raises(TypeError, match=r"hash_values: slot must be an int, got 1.5"):
        hashing.hash_values([], slot=1.5)
    with pytest.raises(TypeError, match=r"hash_values: seed must be an int, got False"):
        hashing.hash_values(np.array([], dtype=np.int64), seed=False)


@pytest.mark.parametrize("values", [None, 5, 1.5, np.float64(1.0), object()])
def test_hash_values_refuses_a_non_iterable_naming_it(values):
    with pytest.raises(TypeError, match=r"sparsekit.hashing.hash_values: values must be an iterable of str, bytes "
                                        r"or int values .*, got .*hash a single value with hash_value"):
        hashing.hash_values(values)


def test_hash_values_takes_any_iterable():
    expected = [hashing.hash_value(v, 2) for v in ["a", 1, b"c"]]
    assert hashing.hash_values((v for v in ["a", 1, b"c"]), 2).tolist() == expected
    assert hashing.hash_values(iter(("a", 1, b"c")), 2).tolist() == expected
    assert hashing.hash_values(("a", 1, b"c"), 2).tolist() == expected
    assert hashing.hash_values(range(3)).tolist() == [hashing.hash_value(v) for v in range(3)]
    # An array.array is a container of its elements, as a numpy array is.
    assert hashing.hash_values(array.array("q", [1, -2])).tolist() == [hashing.hash_value(1), hashing.hash_value(-2)]


@pytest.mark.parametrize("rows", [None, 5, (row for row in [["a"]]), iter([["a"]]), {0: ["a"]}, torch.tensor(1),
                                  np.array(1)])
def test_hash_rows_refuses_rows_that_are_not_a_sequence(rows):
    with pytest.raises(TypeError, match=r"sparsekit.hashing.hash_rows: rows must be a sequence of rows \(a list, "
                                        r"tuple, 2-d array or tensor\), got "):
        hashing.hash_rows(rows)


def test_hash_rows_hints_for_iterators_and_mappings():
    with pytest.raises(TypeError, match=r"\(generator\); pass list\(...\)"):
        hashing.hash_rows(row for row in [["a"]])
    with pytest.raises(TypeError, match=r"\(dict\); a mapping would be read as its keys"):
        hashing.hash_rows({0: ["a"]})
    with pytest.raises(TypeError, match=r"row 0 must be .*\(set\); a set has no fixed order"):
        hashing.hash_rows([{"a", "b"}])


@pytest.mark.parametrize("values, kind", [({"a": 1, "b": 2}, r"dict\); a mapping would be read as its keys"),
                                          ({"a", "b"}, r"set\); a set has no fixed order"),
                                          (frozenset([1, 2]), r"frozenset\); a set has no fixed order")])
def test_hash_values_refuses_mappings_and_sets(values, kind):
    # A dict would be hashed as its keys, a set in an order salted per process: out[i]
    # would match no values[i].
    with pytest.raises(TypeError, match=r"sparsekit.hashing.hash_values: values must be .*\(" + kind):
        hashing.hash_values(values)


def test_hash_values_takes_a_dict_s_keys_view_in_its_order():
    """A dict's keys() is a Set, but it keeps the dict's order: it hashes as list(keys())."""
    values = {"b": 1, "a": 2}
    assert hashing.hash_values(values.keys()).tolist() == hashing.hash_values(["b", "a"]).tolist()


@pytest.mark.parametrize("row", [None, 5, {"feature": "a"}, (value for value in "a")])
def test_hash_rows_refuses_a_row_that_is_not_a_sequence(row):
    with pytest.raises(TypeError, match=r"sparsekit.hashing.hash_rows: row 1 must be a sequence of values .*, got "):
        hashing.hash_rows([["a"], row])


def test_hash_rows_takes_sequences_arrays_and_tensors():
    expected = [[hashing.hash_value("a", 0), hashing.hash_value(1, 1)], [hashing.hash_value(b"b", 0),
                                                                           hashing.hash_value(2, 1)]]
    assert hashing.hash_rows((("a", 1), (b"b", 2))).tolist() == expected
    assert hashing.hash_rows([np.array(["a", "b"]), ("c", "d")]).tolist() == \
        hashing.hash_rows([["a", "b"], ["c", "d"]]).tolist()
    assert hashing.hash_rows(torch.tensor([[1, 2]])).tolist() == [[hashing.hash_value(1, 0), hashing.hash_value(2, 1)]]
    assert hashing.hash_rows(np.array([[3, 4]])).tolist() == [[hashing.hash_value(3, 0), hashing.hash_value(4, 1)]]
    assert hashing.hash_rows([[], []]).shape == (2, 0)


def _xxh3(data, slot=0, seed=0):
    digest = xxhash.xxh3_64_intdigest(bytes(data), hashing.slot_seed(slot, seed))
    return digest - (1 << 64) if digest >= 1 << 63 else digest


def test_any_buffer_protocol_object_is_hashed_as_its_bytes():
    """hash_value documents bytes-like values: every buffer exporter is hashed as its raw bytes."""
    assert hashing.hash_value(array.array("B", b"ab"), 3) == hashing.hash_value(b"ab", 3) == _xxh3(b"ab", 3)
    ints = array.array("i", [1, -2, 3])
    assert hashing.hash_value(ints, 1, seed=5) == _xxh3(ints.tobytes(), 1, 5)
    with mmap.mmap(-1, 4) as mapped:
        mapped.write(b"wxyz")
        assert hashing.hash_value(mapped) == hashing.hash_value(b"wxyz")
    # Multi-dimensional and non-contiguous buffers: their bytes in C order.
    grid = memoryview(bytes(range(12))).cast("B", (3, 4))
    assert hashing.hash_value(grid) == hashing.hash_value(bytes(range(12)))
    assert hashing.hash_value(grid[::2]) == _xxh3(grid[::2].tobytes())
    assert hashing.hash_value(memoryview(b"abcdef")[::2]) == hashing.hash_value(b"ace")
    # In hash_values and hash_rows as values too.
    assert hashing.hash_values([array.array("B", b"ab")], 2).tolist() == [_xxh3(b"ab", 2)]
    assert hashing.hash_rows([[1, array.array("B", b"ab")]]).tolist() == [[hashing.hash_value(1), _xxh3(b"ab", 1)]]


def test_numpy_buffers_are_not_bytes_like():
    """numpy arrays and scalars export buffers, but of elements: integers still hash as integers
    and the rest is still refused (a float64 is not hashed as its 8 bytes)."""
    assert hashing.hash_value(np.int32(7)) == hashing.hash_value(np.array(7)) == hashing.hash_value(7)
    for value in (np.float64(1.0), np.float32(1.0), np.array(1.5)):
        with pytest.raises(TypeError, match="cannot hash a (float64|float32|ndarray)"):
            hashing.hash_value(value)
    for value in (np.array([1, 2]), torch.tensor([1, 2])):
        with pytest.raises(TypeError, match=r"cannot hash a (ndarray|Tensor); .*hash_values"):
            hashing.hash_value(value)


def test_a_tensor_of_one_element_is_not_one_value():
    """torch.tensor([7]) converts with operator.index, numpy's array([7]) does not: both are
    sequences, refused as one value (a 3-d tensor of rows was read as a 2-d one)."""
    assert hashing.hash_value(torch.tensor(7)) == hashing.hash_value(7)
    for value in (torch.tensor([7]), torch.tensor([[7]])):
        with pytest.raises(TypeError, match=r"cannot hash a \d-d tensor of shape"):
            hashing.hash_value(value)
    with pytest.raises(TypeError, match=r"cannot hash a 1-d tensor of shape \[1\]"):
        hashing.hash_rows(torch.tensor([[[1], [2]]]))


def test_a_uint64_scalar_past_int64_and_a_meta_scalar_get_the_documented_errors():
    """A 0-d uint64 tensor of 2^63 was torch's RuntimeError (it reads tensors as int64) in
    hash_value and hash_rows, where an int past int64 is an OverflowError; a meta one was
    'Tensor.item() cannot be called on meta tensors'."""
    big = torch.tensor(2**63, dtype=torch.uint64)
    assert hashing.hash_value(torch.tensor(2**62, dtype=torch.uint64)) == hashing.hash_value(2**62)
    for call in (lambda: hashing.hash_value(big), lambda: hashing.hash_rows([[big]])):
        with pytest.raises(OverflowError, match="integer 9223372036854775808 is outside the int64 range"):
            call()
    meta = torch.empty((), dtype=torch.int64, device="meta")
    for call in (lambda: hashing.hash_value(meta), lambda: hashing.hash_rows([[meta]])):
        with pytest.raises(TypeError, match="cannot hash a tensor on the meta device"):
            call()
    # A seed given as such a tensor: its value, taken modulo 2^64 as every seed is.
    assert hashing.hash_value("a", seed=big) == hashing.hash_value("a", seed=2**63)


@pytest.mark.parametrize("values, what", [(torch.tensor([1, 2]).to_sparse(), "torch.sparse_coo tensor"),
                                          (torch.tensor([1, 2], device="meta"), "meta tensor")])
def test_hash_values_names_a_tensor_without_dense_values(values, what):
    with pytest.raises(TypeError, match=rf"hash_values: values is a {what}"):
        hashing.hash_values(values)


def test_a_refused_value_is_named_by_its_place():
    """A bad value among many names the function and its position, keeping its error type."""
    with pytest.raises(TypeError, match=r"^sparsekit.hashing.hash_values: values\[1000000\]: cannot hash a float"):
        hashing.hash_values([1, 2] * 500_000 + [3.0])
    with pytest.raises(TypeError, match=r"^sparsekit.hashing.hash_rows: rows\[1\]\[1\]: cannot hash a float"):
        hashing.hash_rows([[1, 2], [3, 4.5]])
    with pytest.raises(OverflowError, match=r"^sparsekit.hashing.hash_values: values\[2\]: integer 18446744073709551616"):
        hashing.hash_values(iter([1, "a", 2**64]))
    # What the caller's own iterable raises passes as it is, with its type.
    with pytest.raises(UnicodeDecodeError):
        hashing.hash_values(b.decode() for b in [b"a", b"\xff"])
    with pytest.raises(ValueError, match=r"^invalid literal for int\(\)"):
        hashing.hash_values(int(s) for s in ["1", "x"])
