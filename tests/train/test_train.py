"""The training harness (python -m sparsekit.train): data, metrics, Criteo reader, runs."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import sparsekit as sk
from sparsekit import hashing
from sparsekit.train.criteo import (
    CriteoFormatError,
    CriteoParser,
    CriteoTSV,
    LineIndex,
    benchmark_reader,
    write_synthetic_tsv,
)
from sparsekit.train.data import (
    NUM_DENSE,
    NUM_SLOTS,
    FoldedZipf,
    SyntheticCriteo,
    hurwitz_zeta,
    rank_slice,
)
from sparsekit.train.loop import TrainConfig, train
from sparsekit.train.metrics import log_loss, roc_auc
from sparsekit.train.model import DLRM, TorchSlotEmbedding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")  # any existing file
EMBEDDINGS = ["sparsekit", "torch"]
TINY = dict(steps=12, batch_size=128, eval_samples=1024, eval_every=6, embedding_dim=8,
            table_rows=1 << 16, vocab_per_slot=2000, lr=1e-2, device="cpu", progress=False)


def tiny(**overrides) -> TrainConfig:
    return TrainConfig(**{**TINY, **overrides})


# ---- synthetic data ----

def test_synthetic_is_deterministic_and_world_size_independent():
    source = SyntheticCriteo(3, vocab_per_slot=500)
    whole = source.train_batch(7, 96)
    assert whole.dense.shape == (96, NUM_DENSE) and whole.dense.dtype == torch.float32
    assert whole.keys.shape == (96, NUM_SLOTS) and whole.keys.dtype == torch.int64
    assert whole.labels.shape == (96,) and set(whole.labels.unique().tolist()) <= {0.0, 1.0}
    again = SyntheticCriteo(3, vocab_per_slot=500).train_batch(7, 96)
    assert torch.equal(whole.keys, again.keys) and torch.equal(whole.labels, again.labels)
    for world_size in (2, 3, 4):
        parts = [source.train_batch(7, 96, rank, world_size) for rank in range(world_size)]
        assert torch.equal(torch.cat([p.keys for p in parts]), whole.keys)
        assert torch.equal(torch.cat([p.dense for p in parts]), whole.dense)
        assert torch.equal(torch.cat([p.labels for p in parts]), whole.labels)
    assert not torch.equal(source.train_batch(8, 96).keys, whole.keys)
    assert not torch.equal(SyntheticCriteo(4, vocab_per_slot=500).train_batch(7, 96).keys, whole.keys)
    held_out = next(source.eval_batches(96, 96))
    assert not torch.equal(held_out.keys, whole.keys)


@pytest.mark.parametrize("s", [1.01, 1.2, 2.0, 7.5])
def test_hurwitz_zeta_matches_mpmath(s):
    mpmath = pytest.importorskip("mpmath")
    q = np.array([1e-4, 0.3, 1.0, 2.5, 17.0, 1e4])
    expected = np.array([float(mpmath.zeta(s, float(x))) for x in q])
    np.testing.assert_allclose(hurwitz_zeta(s, q), expected, rtol=1e-13)


@pytest.mark.parametrize("alpha", [1.01, 1.2, 2.0, 5.0])
@pytest.mark.parametrize("vocab", [1, 2, 7, 1000])
def test_folded_zipf_has_the_law_of_numpys_zipf_folded(alpha, vocab):
    mpmath = pytest.importorskip("mpmath")
    sampler = FoldedZipf(alpha, vocab)
    # P(rank k) ~ sum over j of (k + 1 + j vocab)^-alpha, terms up to 2^63 - 1 (numpy's largest).
    mpmath.mp.dps = 40
    weights = []
    for k in range(vocab):
        q, terms = mpmath.mpf(k + 1) / vocab, ((1 << 63) - 2 - k) // vocab + 1
        weights.append(mpmath.zeta(alpha, q) - mpmath.zeta(alpha, q + terms))
    exact = np.array([float(w / sum(weights)) for w in weights])
    np.testing.assert_allclose(sampler.probabilities, exact, rtol=1e-12, atol=1e-300)
    # The alias table holds exactly that mass: column k's own part, plus the parts of the
    # columns whose alias is k.
    mass = sampler.keep / vocab
    np.add.at(mass, sampler.alias, (1.0 - sampler.keep) / vocab)
    np.testing.assert_allclose(mass, sampler.probabilities, rtol=1e-9, atol=1e-15)
    assert np.all((sampler.keep >= 0) & (sampler.keep <= 1))
    # Draws: a column from the uniform's integer part, then the column's rank or its alias.
    ranks = sampler.draw(np.random.default_rng(5), (400_000,))
    assert ranks.dtype == np.int64 and ranks.min() >= 0 and ranks.max() < vocab
    frequencies = np.bincount(ranks, minlength=vocab) / ranks.size
    # Total variation to the law: within sampling noise.
    assert 0.5 * np.abs(frequencies - sampler.probabilities).sum() < 0.02
    if alpha >= 1.2:
        # And to numpy's own draws. Not at alpha 1.01, where a tenth of numpy's values lie
        # above 2^53 and are doubles, all even: its folded frequencies lean to even values.
        numpys = np.bincount((np.random.default_rng(6).zipf(alpha, ranks.size) - 1) % vocab,
                             minlength=vocab) / ranks.size
        assert 0.5 * np.abs(frequencies - numpys).sum() < 0.03


def test_folded_zipf_draws_map_uniforms_through_the_alias_table():
    sampler = FoldedZipf(1.2, 50)

    class Fixed:
        def random(self, size):
            return np.array([0.0, 0.999999999999, 0.5, 0.123456]).reshape(size)

    scaled = Fixed().random((4,)) * 50
    column = np.minimum(scaled.astype(np.int64), 49)
    expected = np.where(scaled - column < sampler.keep[column], column, sampler.alias[column])
    assert np.array_equal(sampler.draw(Fixed(), (4,)), expected)
    assert sampler.draw(np.random.default_rng(0), (3, 0)).shape == (3, 0)


@pytest.mark.parametrize("alpha, vocab, message", [(1.0, 10, "alpha must be > 1"), (float("nan"), 10, "alpha"),
                                                    (1.2, 0, "vocab must be >= 1")])
def test_folded_zipf_rejects_bad_arguments(alpha, vocab, message):
    with pytest.raises(ValueError, match=message):
        FoldedZipf(alpha, vocab)
    with pytest.raises(ValueError, match="SyntheticCriteo"):
        SyntheticCriteo(0, vocab_per_slot=vocab, zipf_alpha=alpha)


def test_synthetic_keys_are_salted_per_slot_and_zipf_skewed():
    source = SyntheticCriteo(0, vocab_per_slot=1000)
    ranks = np.zeros((1, NUM_SLOTS), dtype=np.int64)
    assert len(set(source.keys_of(ranks)[0].tolist())) == NUM_SLOTS  # rank 0 differs per slot
    keys = source.train_batch(0, 4096).keys[:, 0]
    _, counts = torch.unique(keys, return_counts=True)
    assert counts.max() > 0.1 * keys.numel()  # the head key is frequent
    assert 0.8 < source.oracle_auc(8192, 4096) < 1.0


def test_rank_slice_partitions():
    for size in (0, 1, 7, 128):
        for world_size in (1, 2, 3, 4):
            rows = [rank_slice(size, rank, world_size) for rank in range(world_size)]
            covered = [i for part in rows for i in range(size)[part]]
            assert covered == list(range(size))


def test_mix64_is_splitmix64():
    """The synthetic keys' mix is splitmix64 (Vigna): its published outputs for seeds 0 and
    1234567 (the generator's output for state s is the mix of s)."""
    from sparsekit.train.data import _mix64
    golden = 0x9E3779B97F4A7C15
    states = np.array([0] + [(1234567 + i * golden) % (1 << 64) for i in range(5)], dtype=np.uint64)
    assert [int(v) for v in _mix64(states)] == [
        0xE220A8397B1DCDAF, 6457827717110365317, 3203168211198807973, 9817491932198370423,
        4593380528125082431, 16408922859458223821]


def test_eval_batches_hold_exactly_num_samples():
    """A held-out set whose size is not a multiple of the batch: the last batch is the rest,
    on every world size."""
    source = SyntheticCriteo(1, vocab_per_slot=100)
    for world_size in (1, 3):
        sizes = [len(batch) for rank in range(world_size)
                 for batch in source.eval_batches(100, 64, rank, world_size)]
        assert sum(sizes) == 100, sizes


def test_synthetic_labels_follow_the_documented_hidden_model():
    """raw(): logit = bias + sum_slot effect[slot, rank_slot] + w . (dense - 1.5), dense the
    log1p transform of the raw counts with -1 (about 10 %) for a missing value."""
    source = SyntheticCriteo(2, vocab_per_slot=50)
    raw_dense, ranks, _, probabilities = source.raw(1, 0, 256)
    assert raw_dense.min() >= -1 and 0.05 < (raw_dense == -1).mean() < 0.15
    effects = np.stack([source._effects[slot, ranks[:, slot]] for slot in range(NUM_SLOTS)], axis=1)
    dense = np.log1p(np.maximum(raw_dense, 0).astype(np.float64))
    logit = float(source._bias) + effects.astype(np.float64).sum(axis=1) \
        + (dense - 1.5) @ source._dense_weight.astype(np.float64)
    np.testing.assert_allclose(probabilities, 1.0 / (1.0 + np.exp(-logit)), rtol=1e-5, atol=1e-6)


# ---- model ----

def test_dlrm_interactions_are_the_upper_triangle_dot_products_in_order():
    torch.manual_seed(0)
    dim = 4
    model = DLRM(TorchSlotEmbedding(1000, dim, torch.device("cpu")), dim)
    dense = torch.randn(5, NUM_DENSE)
    keys = torch.randint(-(1 << 62), 1 << 62, (5, NUM_SLOTS))
    seen = {}
    model.top.register_forward_hook(lambda module, args, out: seen.update(top_in=args[0]))
    logits = model(dense, keys)
    bottom = model.bottom(dense)
    vectors = torch.cat([bottom.unsqueeze(1), model.embedding(keys)], dim=1)
    expected = [vectors[:, i] @ vectors[:, j].T for i in range(NUM_SLOTS + 1) for j in range(i + 1, NUM_SLOTS + 1)]
    expected = torch.stack([e.diagonal() for e in expected], dim=1)
    assert seen["top_in"].shape == (5, dim + expected.shape[1])
    torch.testing.assert_close(seen["top_in"][:, dim:], expected)
    # Gradients reach every vector of every sample.
    logits.sum().backward()
    assert model.embedding.bag.weight.grad is not None and model.bottom[0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("batch,n,dim", [(0, 27, 16), (1, 2, 1), (3, 5, 4), (64, 27, 16)])
def test_pair_dots_gradient_is_autograds_through_the_full_products(batch, n, dim):
    """The interaction's one-product backward (S V with both triangles of S filled) is the
    gradient autograd takes through bmm(V, V^T) and the gather, in float64 to rounding
    and by gradcheck, for empty batches, one pair and the harness's 27 vectors."""
    from sparsekit.train.model import _PairDots

    torch.manual_seed(batch + n)
    pairs = torch.triu_indices(n, n, offset=1)
    upper = (pairs[0] * n + pairs[1]).unsqueeze(0)
    lower = (pairs[1] * n + pairs[0]).unsqueeze(0)
    vectors = torch.randn(batch, n, dim, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(batch, pairs.shape[1], dtype=torch.float64)
    out = _PairDots.apply(vectors, upper, lower)
    products = torch.bmm(vectors, vectors.transpose(1, 2))
    reference = torch.gather(products.flatten(1), 1, upper.expand(batch, -1))
    # (sparsekit's CPU kernel sums each product in its own order: equal to rounding.)
    torch.testing.assert_close(out, reference)
    (got,) = torch.autograd.grad(out, vectors, grad)
    (expected,) = torch.autograd.grad(reference, vectors, grad)
    torch.testing.assert_close(got, expected)
    # Each vector's gradient is the sum of its partners weighted by the pairs' gradients.
    by_hand = torch.zeros_like(vectors)
    for p, (i, j) in enumerate(pairs.T.tolist()):
        by_hand[:, i] += grad[:, p, None] * vectors[:, j].detach()
        by_hand[:, j] += grad[:, p, None] * vectors[:, i].detach()
    torch.testing.assert_close(got, by_hand)
    if 0 < batch <= 3:
        assert torch.autograd.gradcheck(lambda v: _PairDots.apply(v, upper, lower), (vectors,))


# ---- metrics ----

def test_roc_auc_matches_pairwise_definition():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 20, (500,), generator=generator).float()  # many ties
    labels = (torch.rand(500, generator=generator) < 0.3).float()
    positive, negative = scores[labels == 1], scores[labels == 0]
    pairwise = ((positive[:, None] > negative[None, :]).double()
                + 0.5 * (positive[:, None] == negative[None, :]).double()).mean().item()
    assert roc_auc(scores, labels) == pytest.approx(pairwise, abs=1e-12)
    assert roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    assert roc_auc(torch.tensor([0.9, 0.1]), torch.tensor([0.0, 1.0])) == 0.0
    assert math.isnan(roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([1.0, 1.0])))
    # A diverged model's NaN scores sorted above every number: a perfect AUC beside a NaN log loss.
    assert math.isnan(roc_auc(torch.tensor([math.nan, math.nan, 0.3, 0.4]), torch.tensor([1.0, 1.0, 0.0, 0.0])))


def test_log_loss():
    p = torch.tensor([0.9, 0.2, 0.5])
    y = torch.tensor([1.0, 0.0, 1.0])
    expected = -(math.log(0.9) + math.log(0.8) + math.log(0.5)) / 3
    assert log_loss(p, y) == pytest.approx(expected)
    assert math.isfinite(log_loss(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])))


def test_roc_auc_keeps_float64_scores_apart():
    """Scores closer than float32 resolves are still ordered (no false ties)."""
    scores = torch.tensor([1.0, 1.0 + 1e-12], dtype=torch.float64)
    assert roc_auc(scores, torch.tensor([0.0, 1.0])) == 1.0
    assert roc_auc(scores, torch.tensor([1.0, 0.0])) == 0.0


# ---- Criteo TSV reader ----

def _line(label, dense, categorical, sep="\t"):
    return sep.join([label, *dense, *categorical])


def _write(path, lines, end="\n"):
    with open(path, "w", newline="") as out:
        out.write(end.join(lines) + end)


DENSE_A = ["5", "", "-3", "0", "1", "2", "", "10", "100", "", "7", "0", ""]
CATS_A = ["68fd1e64", "", "80e26c9b", "fb936136", "7b4723c4", "25c83c98", "7e0ccccf",
          "de7995b8", "1f89b562", "a73ee510", "a8cd5504", "b2cb9c98", "37c9c164",
          "2824a5f6", "1adce6ef", "8ba8b39a", "891b62e7", "e5ba7672", "f54016b9",
          "21ddcdc9", "b1252a9d", "07b5194c", "", "3a171ecb", "c5c50484", ""]
CATS_B = [""] * NUM_SLOTS
DENSE_B = [""] * NUM_DENSE


def test_criteo_parses_exact_format_with_missing_fields(tmp_path):
    path = tmp_path / "day.tsv"
    _write(path, [_line("1", DENSE_A, CATS_A), _line("0", DENSE_B, CATS_B)])
    source = CriteoTSV(str(path), eval_samples=0)
    assert source.num_train == 2
    batch = source.train_batch(0, 2)
    assert batch.labels.tolist() == [1.0, 0.0]
    raw = [float(x) if x else 0.0 for x in DENSE_A]
    expected = torch.tensor([math.log1p(max(x, 0.0)) for x in raw], dtype=torch.float32)
    torch.testing.assert_close(batch.dense[0], expected)
    assert torch.equal(batch.dense[1], torch.zeros(NUM_DENSE))
    for slot, value in enumerate(CATS_A):
        assert batch.keys[0, slot].item() == hashing.hash_value(value.encode(), slot)
    missing = batch.keys[1]
    # One "missing" key per slot: the hash of the empty string in that slot.
    assert missing.tolist() == [hashing.hash_value(b"", slot) for slot in range(NUM_SLOTS)]
    assert missing.unique().numel() == NUM_SLOTS
    assert batch.keys[0, 1] == missing[1]  # an empty field in a full line too


@pytest.mark.parametrize("build, call, error, message", [
    ({"eval_samples": -2}, None, ValueError, r"CriteoTSV: eval_samples must be a non-negative int, got -2"),
    ({"eval_samples": 1.5}, None, TypeError, r"CriteoTSV: eval_samples must be an int, got 1\.5"),
    ({"eval_samples": 1}, ("train_batch", 0, 0), ValueError, r"train_batch: global_size must be a positive int"),
    ({"eval_samples": 1}, ("train_batch", 0, 4, 5, 2), ValueError, r"train_batch: rank must lie in \[0, world_size=2\)"),
    ({"eval_samples": 1}, ("train_batch", 0, 4, 0, 0), ValueError, r"train_batch: world_size must be a positive int"),
    ({"eval_samples": 1}, ("train_batch", 1.5, 4), TypeError, r"train_batch: step must be an int"),
    ({"eval_samples": 1}, ("eval_batches", -1, 4), ValueError, r"eval_batches: num_samples must be a non-negative"),
    ({"eval_samples": 1}, ("eval_batches", 1, 0), ValueError, r"eval_batches: global_size must be a positive int"),
])
def test_criteo_reader_refuses_bad_counts_naming_the_argument(tmp_path, build, call, error, message):
    """A negative eval_samples made num_train exceed the file (the first batch blamed a line
    past its end); global_size 0 or a rank beyond the world gave empty batches silently,
    world_size 0 a ZeroDivisionError, a float step an IndexError."""
    path = tmp_path / "day.tsv"
    _write(path, [_line("1", DENSE_A, CATS_A)] * 3)
    with pytest.raises(error, match=message):
        source = CriteoTSV(str(path), **build)
        name, *args = call
        list(getattr(source, name)(*args)) if name == "eval_batches" else getattr(source, name)(*args)


def test_criteo_crlf_and_no_final_newline(tmp_path):
    crlf = tmp_path / "crlf.tsv"
    _write(crlf, [_line("1", DENSE_A, CATS_A)] * 3, end="\r\n")
    bare = tmp_path / "bare.tsv"
    bare.write_text("\n".join([_line("1", DENSE_A, CATS_A)] * 3))
    a = CriteoTSV(str(crlf), eval_samples=1).train_batch(0, 2)
    b = CriteoTSV(str(bare), eval_samples=1).train_batch(0, 2)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.dense, b.dense)
    assert LineIndex(str(bare)).num_lines == 3


@pytest.mark.parametrize("bad_line,message", [
    (_line("1", DENSE_A, CATS_A[:-1]), r"expected 40 tab-separated fields .* got 39"),
    (_line("1", DENSE_A, CATS_A) + "\textra", r"expected 40 .* got 41"),
    (_line("2", DENSE_A, CATS_A), r"label must be 0 or 1, got b'2'"),
    (_line("1", DENSE_A[:4] + ["1.5"] + DENSE_A[5:], CATS_A), r"integer feature I5 is not an integer: b'1\.5'"),
    ("", r"expected 40 .* got 1$"),
])
def test_criteo_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "broken.tsv"
    good = _line("0", DENSE_A, CATS_A)
    _write(path, [good, good, bad_line, good])
    source = CriteoTSV(str(path), eval_samples=0)
    with pytest.raises(CriteoFormatError, match=rf"broken\.tsv:3: {message}"):
        source.train_batch(0, 4)
    # A rank whose slice does not hold the bad line parses its own lines fine.
    assert len(source.train_batch(0, 4, rank=0, world_size=2)) == 2


HUGE = "1" + "0" * 400  # beyond float64 (1.8e308), within the digits int() reads


@pytest.mark.parametrize("count,message", [
    (HUGE, r"integer feature I3 is too large: b'1000+'\.\.\. \(401 digits\); counts must lie within the "
           r"float64 range, \|x\| < 1\.8e308$"),
    ("-" + HUGE, r"integer feature I3 is too large a negative number: .* \(401 digits\)"),
    ("2" + "0" * 308, r"integer feature I3 is too large: .* \(309 digits\)"),  # 2e308
    # More digits than int() reads (sys.get_int_max_str_digits(), 4300): still an integer.
    ("1" + "0" * 4999, r"integer feature I3 is too large: .* \(5000 digits\)"),
])
def test_criteo_count_beyond_float64_names_line_and_column(tmp_path, count, message):
    path = tmp_path / "huge.tsv"
    good = _line("0", DENSE_A, CATS_A)
    _write(path, [good] * 100 + [_line("1", DENSE_A[:2] + [count] + DENSE_A[3:], CATS_A), good])
    source = CriteoTSV(str(path), eval_samples=0)
    with pytest.raises(CriteoFormatError, match=rf"huge\.tsv:101: {message}"):
        source.train_batch(0, 102)


@pytest.mark.parametrize("count,expected", [
    ("1" + "0" * 308, math.log1p(1e308)),  # the largest powers of ten float64 holds
    ("17" + "0" * 307, math.log1p(1.7e308)),
    ("0" * 5000 + "7", math.log1p(7)),  # too many digits for int(), but only leading zeros
    ("-" + "0" * 5000 + "7", 0.0),
    ("-" + "1" + "0" * 307, 0.0),
    (str(2**64), math.log1p(2.0**64)),
])
def test_criteo_counts_within_float64_are_read(tmp_path, count, expected):
    path = tmp_path / "large.tsv"
    _write(path, [_line("1", [count] + DENSE_A[1:], CATS_A)])
    batch = CriteoTSV(str(path), eval_samples=0).train_batch(0, 1)
    assert batch.dense[0, 0].item() == pytest.approx(expected, rel=1e-6)


def test_criteo_holdout_wraparound_and_rank_slices(tmp_path):
    path = str(tmp_path / "synthetic.tsv")
    write_synthetic_tsv(path, 50, seed=1)
    lines = open(path, "rb").read().splitlines()
    assert len(lines) == 50 and all(len(line.split(b"\t")) == 40 for line in lines)
    parser = CriteoParser(path)
    everything = parser.parse(lines, range(1, 51))
    source = CriteoTSV(path, eval_samples=10)
    assert source.num_train == 40
    held_out = list(source.eval_batches(10, 4))
    assert [len(b) for b in held_out] == [4, 4, 2]
    assert torch.equal(torch.cat([b.keys for b in held_out]), everything.keys[40:])
    # Global batch 3 of size 16 covers lines 48..63 of the training part: it wraps.
    batch = source.train_batch(3, 16)
    order = [(3 * 16 + i) % 40 for i in range(16)]
    assert torch.equal(batch.keys, everything.keys[order])
    assert torch.equal(batch.labels, everything.labels[order])
    # Random access and sequential reading agree, whatever the seek anchors are.
    source._index = LineIndex(path, stride=3)
    for step in (5, 0, 1, 2):
        expected = everything.keys[[(step * 7 + i) % 40 for i in range(7)]]
        assert torch.equal(source.train_batch(step, 7).keys, expected)
        parts = [source.train_batch(step, 7, rank, 3).keys for rank in range(3)]
        assert torch.equal(torch.cat(parts), expected)
    source.close()


def test_criteo_too_small_for_holdout(tmp_path):
    path = str(tmp_path / "small.tsv")
    write_synthetic_tsv(path, 5)
    with pytest.raises(ValueError, match="lower --eval-samples"):
        CriteoTSV(path, eval_samples=5)


def test_benchmark_reader_counts_lines(tmp_path):
    path = str(tmp_path / "bench.tsv")
    write_synthetic_tsv(path, 300)
    result = benchmark_reader(path, batch_size=100)
    assert result["lines"] == 300 and result["lines_per_s"] > 0


# ---- the harness, end to end ----

def _check_metrics(result, *, steps, world_size):
    for key in ("auc", "logloss", "samples_per_s", "steps", "world_size"):
        assert key in result
    assert result["steps"] == steps and result["world_size"] == world_size
    assert 0.0 <= result["auc"] <= 1.0 and result["logloss"] > 0 and result["samples_per_s"] > 0


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_harness_learns_on_synthetic_data(tmp_path, embedding):
    metrics_path = tmp_path / "metrics.json"
    result = train(tiny(embedding=embedding, steps=60, batch_size=256, eval_samples=4096,
                        eval_every=0, metrics_json=str(metrics_path)))
    _check_metrics(result, steps=60, world_size=1)
    assert result["auc"] > 0.7, result
    assert json.loads(metrics_path.read_text()) == result


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_harness_on_criteo_file(tmp_path, embedding):
    path = str(tmp_path / "day.tsv")
    write_synthetic_tsv(path, 3000)
    result = train(tiny(embedding=embedding, data=path, steps=40, eval_samples=800))
    _check_metrics(result, steps=40, world_size=1)
    assert result["eval_samples"] == 800
    assert result["auc"] > 0.6, result


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_resume_gives_the_uninterrupted_result(tmp_path, embedding):
    straight = train(tiny(embedding=embedding, checkpoint_dir=str(tmp_path / "a")))
    first = train(tiny(embedding=embedding, steps=5, checkpoint_dir=str(tmp_path / "b")))
    assert first["steps"] == 5
    resumed = train(tiny(embedding=embedding, checkpoint_dir=str(tmp_path / "b"), resume=True))
    assert resumed["resumed_from_step"] == 5 and resumed["steps"] == 12
    assert resumed["auc"] == straight["auc"]
    assert resumed["logloss"] == straight["logloss"]
    # Resuming a finished run trains nothing and evaluates the same model.
    again = train(tiny(embedding=embedding, checkpoint_dir=str(tmp_path / "b"), resume=True))
    assert again["resumed_from_step"] == 12 and again["logloss"] == straight["logloss"]


def test_zero_steps_evaluates_once_and_checkpoints_the_untrained_model(tmp_path, monkeypatch):
    """--steps 0: the untrained model is the end: scored once (it was scored twice), and
    checkpointed when --checkpoint-dir is given ("0: only at the end"); resuming from it
    trains as a run from scratch."""
    from sparsekit.train import loop
    calls = []
    evaluate = loop.evaluate
    monkeypatch.setattr(loop, "evaluate", lambda *args: calls.append(1) or evaluate(*args))
    result = train(tiny(steps=0, checkpoint_dir=str(tmp_path)))
    assert len(calls) == 1 and result["steps"] == 0
    assert _step_dirs(tmp_path) == ["ckpt-000000"]
    straight = train(tiny())
    resumed = train(tiny(checkpoint_dir=str(tmp_path), resume=True))
    assert resumed["resumed_from_step"] == 0 and resumed["logloss"] == straight["logloss"]


def test_the_metrics_file_holds_what_the_command_prints(tmp_path, capsys):
    """python -m sparsekit.train printed a field (malloc_keeps_freed_memory) that its
    --metrics-json file lacked."""
    from sparsekit.train.__main__ import main
    path = tmp_path / "metrics.json"
    main(["--device", "cpu", "--no-progress", "--steps", "2", "--batch-size", "64", "--eval-samples", "512",
          "--table-rows", "4096", "--metrics-json", str(path)])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "malloc_keeps_freed_memory" in printed and json.loads(path.read_text()) == printed


def test_dynamic_table_run_logs_fill_evictions_and_admissions(tmp_path, capsys):
    """A table far smaller than the data evicts and still learns; the log shows the table."""
    metrics_path = tmp_path / "metrics.json"
    result = train(tiny(steps=30, eval_every=15, capacity_per_rank=4000, eviction="lru",
                        admit_after=2, metrics_json=str(metrics_path), checkpoint_dir=str(tmp_path / "ckpt")))
    _check_metrics(result, steps=30, world_size=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step") and "table" in line]
    assert lines and all("/4,000" in line and "evicted +" in line and "admitted +" in line for line in lines)
    assert any("evicted +0 " not in line for line in lines)
    resumed = train(tiny(steps=30, eval_every=15, capacity_per_rank=4000, eviction="lru",
                         admit_after=2, checkpoint_dir=str(tmp_path / "ckpt"), resume=True))
    assert resumed["auc"] == result["auc"]


def test_a_resumed_log_counts_evictions_since_the_last_line_as_the_straight_run(tmp_path):
    """The table part of a log line counts evictions and admissions since the previous line;
    after a resume it counted from zero (totals since the start) at its first line."""
    settings = dict(steps=12, eval_every=4, capacity_per_rank=1000, eviction="lru", admit_after=2)
    straight, resumed = [], []
    train(tiny(**settings), log=straight.append)
    train(tiny(**dict(settings, steps=8), checkpoint_dir=str(tmp_path)), log=lambda *_: None)
    train(tiny(**settings, checkpoint_dir=str(tmp_path), resume=True), log=resumed.append)

    def table_part(lines, step):
        line = next(line for line in lines if line.startswith(f"step {step:>6d}"))
        return line[line.index("  table"):]
    assert "evicted +0 " not in table_part(straight, 12)
    assert table_part(resumed, 12) == table_part(straight, 12)


def test_a_resumed_log_averages_the_train_loss_over_the_same_steps_as_the_straight_run(tmp_path):
    """A log line's train_loss averages the steps since the previous line; after a resume
    from a checkpoint between two lines it averaged only the steps after the save, while the
    same line's evictions and admissions counted from the previous line."""
    settings = dict(steps=12, eval_every=4)
    straight, resumed = [], []
    train(tiny(**settings), log=straight.append)

    def train_loss(lines, step):
        line = next(line for line in lines if line.startswith(f"step {step:>6d}"))
        return line.split("train_loss")[1].split()[0]
    # A checkpoint at step 10, between the lines of steps 8 and 12 (as after a crash at step 11).
    ckpt = tmp_path / "mid"
    train(tiny(**dict(settings, steps=12, checkpoint_every=10, keep_checkpoints=5),
               checkpoint_dir=str(ckpt)), log=lambda *_: None)
    (ckpt / "LATEST").write_text("ckpt-000010")
    train(tiny(**settings, checkpoint_dir=str(ckpt), resume=True, keep_checkpoints=5), log=resumed.append)
    assert any(line.startswith("resumed from") for line in resumed)
    assert train_loss(resumed, 12) == train_loss(straight, 12)


def test_a_resumed_log_rates_only_the_steps_this_process_trained(tmp_path, monkeypatch):
    """A log line's samples/s is the rate since the previous line. After a resume from a
    checkpoint between two lines, the steps trained before the save (restored so that
    train_loss averages the same steps) were divided by this process's seconds only: the
    first line's rate was overstated (2x here). A fake clock makes every step one second."""
    import types
    from sparsekit.train import loop

    clock = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    make_data = loop.make_data

    def timed_data(config):
        data = make_data(config)
        batch = data.train_batch

        def train_batch(*args, **kwargs):
            clock[0] += 1.0
            return batch(*args, **kwargs)
        data.train_batch = train_batch
        return data
    monkeypatch.setattr(loop, "make_data", timed_data)
    settings = dict(steps=12, eval_every=4, keep_checkpoints=5)

    def rate(lines, step):
        line = next(line for line in lines if line.startswith(f"step {step:>6d}"))
        return line.split("samples/s")[1].split()[0]
    straight, resumed = [], []
    train(tiny(**settings), log=straight.append)
    ckpt = tmp_path / "mid"
    train(tiny(**settings, checkpoint_every=10, checkpoint_dir=str(ckpt)), log=lambda *_: None)
    (ckpt / "LATEST").write_text("ckpt-000010")
    train(tiny(**settings, checkpoint_dir=str(ckpt), resume=True), log=resumed.append)
    assert rate(straight, 12) == f"{TINY['batch_size']:,}"  # one batch per (fake) second
    assert rate(resumed, 12) == rate(straight, 12)


def test_a_one_process_run_prints_its_result_whatever_rank_the_environment_says(tmp_path, monkeypatch, capsys):
    """Without a process group the run is rank 0 (it logs and writes --metrics-json as such),
    but main() printed the result JSON only when the environment's RANK was unset or "0": a
    stray RANK=1 dropped the line."""
    from sparsekit.train import __main__

    monkeypatch.setattr(__main__, "keep_freed_memory", lambda: False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = tmp_path / "metrics.json"
    __main__.main(["--device", "cpu", "--no-progress", "--steps", "1", "--batch-size", "32", "--eval-every", "0",
                   "--eval-samples", "64", "--table-rows", "4096", "--embedding-dim", "4", "--vocab-per-slot", "100",
                   "--metrics-json", str(path)])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed and json.loads(printed[-1]) == json.loads(path.read_text())


def test_the_torch_embedding_takes_an_empty_batch():
    """A rank's last evaluation batch may hold no sample (fewer held-out samples than ranks
    in it): view(B, 26, -1) cannot infer -1 from 0 elements."""
    embedding = TorchSlotEmbedding(100, 8, torch.device("cpu"))
    assert embedding(torch.zeros(0, 26, dtype=torch.int64)).shape == (0, 26, 8)


def test_a_disk_error_without_a_file_name_is_one_line(capsys, monkeypatch, tmp_path):
    """A full disk (or a failing one) while writing the result: an OSError with an errno
    and no file name was re-raised with its traceback."""
    import errno

    from sparsekit.train import loop

    def full(path, write):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(loop, "write_file", full)
    line = _main_error(capsys, monkeypatch, ["--metrics-json", str(tmp_path / "m.json")], 1)
    assert line.startswith("sparsekit.train: error: ") and "No space left on device" in line
    assert "m.json" in line


def test_a_full_disk_under_a_sparsekit_checkpoint_is_one_line(capsys, monkeypatch, tmp_path):
    """torch.save's zip writer reports a write that failed (a full disk) as a RuntimeError
    ("[enforce fail at inline_container.cc:...] unexpected pos"): save_checkpoint raised it
    with a traceback; it is an OSError naming the file now."""
    def full(obj, f, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 16384 vs 16280")
    monkeypatch.setattr(torch, "save", full)
    line = _main_error(capsys, monkeypatch, ["--checkpoint-dir", str(tmp_path / "ckpt")], 1)
    assert line.startswith("sparsekit.train: error: [Errno 5] torch.save could not write the file")
    assert "is the disk full?" in line and str(tmp_path / "ckpt") in line


def test_a_rank_that_never_joins_is_one_line_on_the_waiting_rank(capsys, monkeypatch):
    """Forming the process group times out (a rank stopped before joining: its data file
    missing on its node): the waiting rank says so in one line, not with the store's traceback."""
    import torch.distributed as dist

    from sparsekit.train import loop

    def never_joins(*args, **kwargs):
        raise dist.DistStoreError("Timed out after 16 seconds waiting for clients. 1/2 clients joined.")
    monkeypatch.setattr(loop.dist, "init_process_group", never_joins)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    line = _main_error(capsys, monkeypatch, [], 1)
    assert line.startswith("sparsekit.train: error: rank 0: the process group did not form (Timed out after 16")
    assert "did not join within --timeout" in line
    # This rank's own failure to form it (its port in use) is not blamed on another rank.
    from sparsekit.train import __main__

    def port_in_use(*args, **kwargs):
        raise dist.DistNetworkError("The server socket has failed to listen on any local network address. "
                                    "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE")
    monkeypatch.setattr(loop.dist, "init_process_group", port_in_use)
    monkeypatch.setattr(__main__, "keep_freed_memory", lambda: False)
    with pytest.raises(dist.DistNetworkError):
        __main__.main(TINY_FLAGS)


def test_resume_from_a_file_refuses_another_held_out_split(tmp_path):
    """With --data FILE the held-out lines decide which lines train: --eval-samples and
    --eval-data are settings a resume must keep (they were not compared)."""
    path = str(tmp_path / "day.tsv")
    write_synthetic_tsv(path, 1200, seed=0)
    base = dict(data=path, steps=2, batch_size=64, eval_samples=200, eval_every=0)
    train(tiny(**base, checkpoint_dir=str(tmp_path / "ckpt")), log=lambda *_: None)
    with pytest.raises(ValueError, match=r"--eval-samples 200 \(now 300\)"):
        train(tiny(**dict(base, eval_samples=300), checkpoint_dir=str(tmp_path / "ckpt"), resume=True))
    with pytest.raises(ValueError, match=r"no --eval-data \(now '.*day.tsv'\)"):
        train(tiny(**base, eval_data=path, checkpoint_dir=str(tmp_path / "ckpt"), resume=True))
    resumed = train(tiny(**dict(base, steps=3), checkpoint_dir=str(tmp_path / "ckpt"), resume=True),
                    log=lambda *_: None)
    assert resumed["resumed_from_step"] == 2
    # A checkpoint written before these were recorded is not held to them.
    trainer = tmp_path / "ckpt" / "ckpt-000003" / "trainer_rank0.pt"
    state = torch.load(trainer, weights_only=True)
    for key in ("eval_samples", "eval_data"):
        del state["config"][key]
    torch.save(state, trainer)
    older = train(tiny(**dict(base, steps=4, eval_samples=300), checkpoint_dir=str(tmp_path / "ckpt"), resume=True),
                  log=lambda *_: None)
    assert older["resumed_from_step"] == 3


def test_a_rank_of_the_checkpoint_without_its_trainer_file_is_refused(tmp_path):
    """Rank 1 of a checkpoint written by 2 ranks whose trainer_rank1.pt is gone: refused
    naming it (it quietly took rank 0's file)."""
    from sparsekit.train import loop

    config = tiny(embedding="torch", steps=2, checkpoint_dir=str(tmp_path))
    train(config, log=lambda *_: None)
    step_dir = tmp_path / "ckpt-000002"
    state = torch.load(step_dir / "trainer_rank0.pt", weights_only=True)
    torch.save(dict(state, world_size=2), step_dir / "trainer_rank0.pt")
    context = loop.Context(rank=1, world_size=2, device=torch.device("cpu"))
    model, _, optimizer = loop.build(config, loop.Context(rank=0, world_size=1, device=torch.device("cpu")))
    with pytest.raises(loop.CheckpointError, match=r"has no trainer_rank1.pt; it is incomplete"):
        loop.load(config, context, 2, model, optimizer)


def test_per_slot_tables_follow_the_shared_table():
    """26 tables in an EmbeddingBagCollection hold the same keys (salted per slot) with
    the same key-seeded vectors and Adam updates as one shared table: the same run."""
    shared = train(tiny())
    per_slot = train(tiny(tables="per-slot"))
    assert per_slot["tables"] == "per-slot"
    assert per_slot["auc"] == pytest.approx(shared["auc"], abs=1e-6)
    assert per_slot["logloss"] == pytest.approx(shared["logloss"], abs=1e-6)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_tables_learn_and_resume(tmp_path, dtype):
    """bf16/fp16 tables (float32 pooling, exchange and Adam moments) learn about as well
    as float32 ones, and resume to the uninterrupted result."""
    full = train(tiny(tables="per-slot"))
    straight = train(tiny(tables="per-slot", embedding_dtype=dtype))
    assert straight["embedding_dtype"] == dtype
    assert straight["auc"] == pytest.approx(full["auc"], abs=0.02)
    train(tiny(tables="per-slot", embedding_dtype=dtype, steps=5, checkpoint_dir=str(tmp_path)))
    resumed = train(tiny(tables="per-slot", embedding_dtype=dtype, checkpoint_dir=str(tmp_path), resume=True))
    assert resumed["resumed_from_step"] == 5
    assert resumed["auc"] == straight["auc"] and resumed["logloss"] == straight["logloss"]


def test_default_holdout_of_a_small_file_is_a_tenth(tmp_path):
    path = str(tmp_path / "small.tsv")
    write_synthetic_tsv(path, 3000)
    result = train(tiny(data=path, steps=5, eval_samples=None))
    assert result["eval_samples"] == 300


def test_keep_checkpoints_prunes_the_oldest(tmp_path):
    train(tiny(steps=6, checkpoint_every=1, keep_checkpoints=3, checkpoint_dir=str(tmp_path)))
    assert _step_dirs(tmp_path) == ["ckpt-000004", "ckpt-000005", "ckpt-000006"]
    assert (tmp_path / "LATEST").read_text() == "ckpt-000006"


def _step_dirs(directory):
    """The names of the entries of ``directory`` that look like checkpoints (``ckpt-*``)."""
    return sorted(name for name in os.listdir(directory) if name.startswith("ckpt-"))


def test_keep_checkpoints_keeps_the_newest_written_not_the_highest_steps(tmp_path):
    """A fresh run into a directory a longer run used: its own checkpoints are the newest."""
    train(tiny(steps=20, eval_every=0, checkpoint_every=5, keep_checkpoints=1, checkpoint_dir=str(tmp_path)))
    assert _step_dirs(tmp_path) == ["ckpt-000020"]
    train(tiny(steps=10, eval_every=0, checkpoint_every=5, keep_checkpoints=1, checkpoint_dir=str(tmp_path)))
    assert _step_dirs(tmp_path) == ["ckpt-000010"]
    assert (tmp_path / "LATEST").read_text() == "ckpt-000010"


def test_keep_checkpoints_orders_earlier_runs_by_modification_time(tmp_path):
    """Checkpoints this run did not write are older than its own, and among themselves
    ordered by when they were written, not by step."""
    for name, modified in (("ckpt-000100", 1_000_000_000), ("ckpt-000050", 1_100_000_000),
                           ("ckpt-000070", 1_050_000_000)):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (modified, modified))
    (tmp_path / "ckpt-000001.txt").write_text("not a checkpoint directory: left alone")
    train(tiny(steps=2, eval_every=0, checkpoint_every=1, keep_checkpoints=3, checkpoint_dir=str(tmp_path)))
    assert _step_dirs(tmp_path) == ["ckpt-000001", "ckpt-000001.txt", "ckpt-000002", "ckpt-000050"]
    assert (tmp_path / "LATEST").read_text() == "ckpt-000002"


def test_a_gzip_data_file_is_named_before_the_run(tmp_path):
    import gzip

    path = tmp_path / "day_0.gz"
    with gzip.open(path, "wt") as out:
        out.write("0\t" + "\t".join(["1"] * 13 + ["a"] * 26) + "\n")
    with pytest.raises(ValueError, match=r"--data '.*day_0.gz' is gzip-compressed; decompress it first"):
        train(TrainConfig(data=str(path)))


def test_resume_refuses_other_settings(tmp_path):
    train(tiny(embedding="torch", steps=2, checkpoint_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="--embedding-dim 8 .now 4."):
        train(tiny(embedding="torch", embedding_dim=4, checkpoint_dir=str(tmp_path), resume=True))


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="--resume needs --checkpoint-dir"):
        train(tiny(embedding="torch", resume=True))
    with pytest.raises(ValueError, match="--embedding must be"):
        train(tiny(embedding="tensorflow"))


@pytest.mark.parametrize("flags, fields, message", [
    (["--steps", "-5"], dict(steps=-5), "--steps must be an integer >= 0"),
    (["--batch-size", "0"], dict(batch_size=0), "--batch-size must be an integer >= 1"),
    (["--batch-size", "-8"], dict(batch_size=-8), "--batch-size must be an integer >= 1"),
    (["--eval-samples", "0"], dict(eval_samples=0), "--eval-samples must be an integer >= 1"),
    (["--eval-every", "-1"], dict(eval_every=-1), "--eval-every must be an integer >= 0"),
    (["--embedding-dim", "0"], dict(embedding_dim=0), "--embedding-dim must be an integer >= 1"),
    (["--lr", "0"], dict(lr=0.0), "--lr must be > 0"),
    (["--timeout", "0"], dict(timeout=0.0), "--timeout must be >= 1 second"),
    (["--timeout", "1e-9"], dict(timeout=1e-9), "--timeout must be >= 1 second"),
    (["--checkpoint-every", "5"], dict(checkpoint_every=5), "--checkpoint-every needs --checkpoint-dir"),
    (["--resume"], dict(resume=True), "--resume needs --checkpoint-dir"),
    (["--capacity-per-rank", "0"], dict(capacity_per_rank=0), "--capacity-per-rank must be an integer >= 1"),
    (["--admit-after", "0"], dict(admit_after=0), "--admit-after must be an integer >= 1"),
    (["--embedding", "torch", "--eviction", "lru"], dict(embedding="torch", eviction="lru"),
     "need --embedding sparsekit"),
    (["--embedding", "torch", "--tables", "per-slot"], dict(embedding="torch", tables="per-slot"),
     "--tables per-slot needs --embedding sparsekit"),
    (["--embedding-dtype", "bf16"], dict(embedding_dtype="bf16"), "needs --tables per-slot"),
    (["--keep-checkpoints", "0"], dict(keep_checkpoints=0), "--keep-checkpoints must be an integer >= 1"),
    (["--data", "/no/such/file.tsv"], dict(data="/no/such/file.tsv"), "--data '/no/such/file.tsv': no such file"),
    (["--data", ROOT], dict(data=ROOT), f"--data {ROOT!r}: is a directory"),
    (["--data", "/dev/null"], dict(data="/dev/null"), "--data '/dev/null': is not a regular file"),
    (["--data", README, "--eval-data", "/no/such/eval.tsv"], dict(data=README, eval_data="/no/such/eval.tsv"),
     "--eval-data '/no/such/eval.tsv': no such file"),
    # Seeds reach numpy (>= 0) and torch (int64).
    (["--seed", "-1"], dict(seed=-1), "--seed must be an integer >= 0, got -1"),
    (["--seed", str(2**63)], dict(seed=2**63), "--seed must be at most 9,223,372,036,854,775,807"),
    (["--seed", str(10**23)], dict(seed=10**23), "--seed must be at most 9,223,372,036,854,775,807"),
    # Sizes whose arrays cannot fit.
    (["--batch-size", str(10**15)], dict(batch_size=10**15), "--batch-size must be at most 1,048,576"),
    (["--vocab-per-slot", str(10**15)], dict(vocab_per_slot=10**15),
     "--vocab-per-slot must be at most 4,194,304"),
    (["--vocab-per-slot", "0"], dict(vocab_per_slot=0), "--vocab-per-slot must be an integer >= 1"),
    (["--steps", str(2**63)], dict(steps=2**63), "--steps must be at most 9,223,372,036,854,775,807"),
    (["--admit-after", str(10**23)], dict(admit_after=10**23), "--admit-after must be at most"),
    (["--capacity-per-rank", str(2**63)], dict(capacity_per_rank=2**63), "--capacity-per-rank must be at most"),
    (["--eval-samples", str(10**15)], dict(eval_samples=10**15),
     "--eval-samples must be at most 4,194,304 with --data synthetic"),
    # A learning rate that trains to NaN, and other non-finite floats.
    (["--lr", "inf"], dict(lr=math.inf), "--lr must be > 0 and at most 1"),
    (["--lr", "1e308"], dict(lr=1e308), "--lr must be > 0 and at most 1"),
    (["--lr", "nan"], dict(lr=math.nan), "--lr must be > 0 and at most 1"),
    (["--lr", "-0.1"], dict(lr=-0.1), "--lr must be > 0"),
    (["--timeout", "inf"], dict(timeout=math.inf), "--timeout must be >= 1 second and at most 604800"),
    (["--timeout", "1e300"], dict(timeout=1e300), "--timeout must be >= 1 second and at most 604800"),
    # Flags that would be ignored, or fail only when the run writes.
    (["--eval-data", README], dict(eval_data=README), "--eval-data needs --data FILE"),
    (["--checkpoint-dir", README], dict(checkpoint_dir=README), "is a file, not a directory"),
    (["--checkpoint-dir", os.path.join(README, "sub")], dict(checkpoint_dir=os.path.join(README, "sub")),
     f"{README!r} is a file, not a directory"),
    (["--metrics-json", ROOT], dict(metrics_json=ROOT), "is a directory; name the file to write"),
    (["--metrics-json", os.path.join(README, "m.json")], dict(metrics_json=os.path.join(README, "m.json")),
     f"{README!r} is a file, not a directory"),
    # An empty path was taken as the flag left out: nothing written, nothing said.
    (["--metrics-json", ""], dict(metrics_json=""), "--metrics-json must not be empty"),
    (["--checkpoint-dir", "", "--resume"], dict(checkpoint_dir="", resume=True), "--checkpoint-dir must not be empty"),
    (["--data", ""], dict(data=""), "--data must not be empty"),
    # The result JSON must not replace a data file or a file of the checkpoints.
    (["--data", README, "--metrics-json", README], dict(data=README, metrics_json=README),
     "is the --data file; writing the result there would replace the data"),
    (["--data", README, "--eval-data", README, "--metrics-json", README],
     dict(data=README, eval_data=README, metrics_json=README), "is the --data file"),
    (["--checkpoint-dir", os.path.join(ROOT, "no_ckpt"), "--metrics-json", os.path.join(ROOT, "no_ckpt", "LATEST")],
     dict(checkpoint_dir=os.path.join(ROOT, "no_ckpt"), metrics_json=os.path.join(ROOT, "no_ckpt", "LATEST")),
     "is --checkpoint-dir's 'LATEST', which the checkpoints own"),
    (["--checkpoint-dir", ROOT, "--metrics-json", os.path.join(ROOT, "ckpt-000004", "m.json")],
     dict(checkpoint_dir=ROOT, metrics_json=os.path.join(ROOT, "ckpt-000004", "m.json")),
     "is --checkpoint-dir's 'ckpt-000004'"),
    pytest.param(["--device", "cuda"], dict(device="cuda"), "--device cuda: no CUDA device is available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is available")),
])
def test_bad_flags_are_argparse_errors(capsys, flags, fields, message):
    """Out-of-range flags exit with status 2 and one line naming the flag (no usage block),
    before anything runs; the same check raises ValueError for a TrainConfig built in code."""
    from sparsekit.train.__main__ import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("python -m sparsekit.train: error: ") and "--help" in err, err
    assert message in err
    with pytest.raises(ValueError, match=re.escape(message)):
        train(TrainConfig(**fields))


# ---- what the command line does with errors the user causes ----

TINY_FLAGS = ["--device", "cpu", "--no-progress", "--steps", "2", "--batch-size", "64", "--eval-samples", "64",
              "--eval-every", "0", "--embedding-dim", "8", "--table-rows", "4096", "--vocab-per-slot", "2000"]


def _main_error(capsys, monkeypatch, argv, status):
    """Run ``main(TINY_FLAGS + argv)`` in this process, expecting it to exit with
    ``status``; returns its error line, the whole of stderr (status 1: a run's error;
    status 2: argparse's)."""
    from sparsekit.train import __main__

    monkeypatch.setattr(__main__, "keep_freed_memory", lambda: False)  # leave this process's malloc alone
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        __main__.main(TINY_FLAGS + argv)
    assert exit_info.value.code == status
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    if status == 1:
        assert err.startswith("sparsekit.train: error: "), err
    else:
        assert err.startswith("python -m sparsekit.train: error: "), err
    return err.splitlines()[-1]


@pytest.mark.parametrize("flags, named", [
    (["--table-rows", str(10**15)], f"--table-rows {10**15} x --embedding-dim 8"),
    (["--embedding-dim", str(10**15)], f"--table-rows 4096 x --embedding-dim {10**15}"),
    (["--capacity-per-rank", str(10**15)], f"--capacity-per-rank {10**15} x --embedding-dim 8"),
    (["--tables", "per-slot", "--embedding-dim", str(10**15)], f"--table-rows 4096 x --embedding-dim {10**15}"),
    (["--embedding", "torch", "--table-rows", str(10**15)], f"--table-rows {10**15} x --embedding-dim 8"),
    (["--embedding", "torch", "--embedding-dim", str(10**15)], f"--table-rows 4096 x --embedding-dim {10**15}"),
    (["--table-rows", "1", "--embedding-dim", str(10**15)], f"--table-rows 1 x --embedding-dim {10**15}"),
    (["--table-rows", str(2**63 - 1)], f"--table-rows {2**63 - 1} x --embedding-dim 8"),
])
def test_tables_too_large_to_allocate_are_argparse_errors(capsys, monkeypatch, flags, named):
    """Only the allocation knows how much fits: its failure is an argparse error naming the flags."""
    line = _main_error(capsys, monkeypatch, flags, 2)
    assert named in line and "cannot be allocated" in line


def test_batch_size_not_a_multiple_of_the_world_size_is_an_argparse_error(capsys, monkeypatch):
    from sparsekit.train import loop

    monkeypatch.setattr(loop, "setup", lambda device, timeout: loop.Context(0, 3, torch.device("cpu")))
    line = _main_error(capsys, monkeypatch, [], 2)
    assert "--batch-size 64 is the global batch; it must be a multiple of the world size 3" in line


def test_full_table_is_one_line_naming_the_flags(capsys, monkeypatch):
    line = _main_error(capsys, monkeypatch, ["--capacity-per-rank", "1"], 1)
    assert "the hash table of rank 0 is full" in line
    assert "raise --capacity-per-rank (now 1) or pass --eviction lru|lfu" in line
    # With eviction given, a table is full only for a step of more keys than it: no advice
    # to pass it; per-slot tables say the rows each table gets.
    line = _main_error(capsys, monkeypatch, ["--tables", "per-slot", "--table-rows", "10", "--eviction", "lfu"], 1)
    assert line.endswith("raise --table-rows (now 10, 26 tables of 1 rows)")


@pytest.mark.parametrize("flag, value", [("--checkpoint-dir", "ckpt"), ("--metrics-json", "out/m.json")])
def test_a_place_the_run_cannot_write_is_an_argparse_error_before_it_trains(capsys, monkeypatch, tmp_path, flag,
                                                                             value):
    """A read-only --checkpoint-dir or --metrics-json was found only after training (at the
    first save, or when the metrics were written). As root, permission bits do not stop a
    write; os.access answers for a read-only file system, and is what the check asks."""
    import sparsekit.train.loop as loop

    real_access = os.access
    monkeypatch.setattr(loop.os, "access", lambda path, mode: False if path == str(tmp_path) else
                        real_access(path, mode))
    line = _main_error(capsys, monkeypatch, [flag, str(tmp_path / value)], 2)
    assert f"{flag} {str(tmp_path / value)!r}: {str(tmp_path)!r} is not writable" in line


# What torch's CPU allocator raises (a plain RuntimeError), e.g. for --batch-size 65536
# --embedding-dim 200000 --table-rows 10: raised here without allocating anything.
CPU_ALLOCATOR_FAILURE = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                         "memory: you tried to allocate 54525952000000 bytes. Error code 12 (Cannot allocate "
                         "memory)")


@pytest.mark.parametrize("embedding", EMBEDDINGS)
@pytest.mark.parametrize("error, detail", [
    (RuntimeError(CPU_ALLOCATOR_FAILURE), CPU_ALLOCATOR_FAILURE[CPU_ALLOCATOR_FAILURE.index("DefaultCPU"):]),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 50.00 GiB"),
     "CUDA out of memory. Tried to allocate 50.00 GiB"),
    (MemoryError("Unable to allocate 50.0 GiB for an array"), "Unable to allocate 50.0 GiB for an array"),
])
def test_out_of_memory_in_the_forward_is_one_line(capsys, monkeypatch, embedding, error, detail):
    from sparsekit.train import model

    def exhausted(self, dense, keys):
        raise error

    monkeypatch.setattr(model.DLRM, "forward", exhausted)
    line = _main_error(capsys, monkeypatch, ["--embedding", embedding], 1)
    assert line == (f"sparsekit.train: error: out of memory: {detail}; lower --batch-size, "
                    "--table-rows/--capacity-per-rank or --embedding-dim")


@pytest.mark.parametrize("message", [
    "mat1 and mat2 shapes cannot be multiplied (64x8 and 9x8)",
    "can't allocate memory",  # not the CPU allocator's message: a bug's own
])
def test_other_runtime_errors_in_the_forward_keep_their_traceback(capsys, monkeypatch, message):
    from sparsekit.train import __main__, model

    def buggy(self, dense, keys):
        raise RuntimeError(message)

    monkeypatch.setattr(model.DLRM, "forward", buggy)
    monkeypatch.setattr(__main__, "keep_freed_memory", lambda: False)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        __main__.main(TINY_FLAGS)


@pytest.fixture
def criteo_files(tmp_path):
    """good.tsv (300 lines), empty.tsv, and broken.tsv: line 5 of 300 has two fields."""
    good = tmp_path / "good.tsv"
    write_synthetic_tsv(str(good), 300)
    (tmp_path / "empty.tsv").write_text("")
    lines = good.read_text().splitlines(keepends=True)
    (tmp_path / "broken.tsv").write_text("".join(lines[:4]) + "1\tx\n" + "".join(lines[5:]))
    return tmp_path


@pytest.mark.parametrize("files, flags, message", [
    (("good", "empty"), [], "empty.tsv: empty held-out file"),
    (("empty", None), [], "empty.tsv: empty training file"),
    (("empty", "good"), [], "empty.tsv: empty training file"),
    (("good", None), ["--eval-samples", "300"], "good.tsv: 300 lines, not enough to hold out eval_samples=300"),
    (("broken", None), ["--eval-samples", "10"], "broken.tsv:5: expected 40 tab-separated fields"),
    (("good", "broken"), [], "broken.tsv:5: expected 40 tab-separated fields"),
])
def test_data_file_errors_are_one_line_naming_the_file(capsys, monkeypatch, criteo_files, files, flags,
                                                       message):
    data, eval_data = files
    argv = ["--data", str(criteo_files / f"{data}.tsv")] + flags
    if eval_data:
        argv += ["--eval-data", str(criteo_files / f"{eval_data}.tsv")]
    line = _main_error(capsys, monkeypatch, argv, 1)
    assert message in line and str(criteo_files) in line


def test_count_beyond_float64_is_one_line_naming_file_line_and_column(capsys, monkeypatch, criteo_files):
    path = criteo_files / "huge.tsv"
    lines = (criteo_files / "good.tsv").read_text().splitlines(keepends=True)
    fields = lines[100].split("\t")
    fields[1] = HUGE
    path.write_text("".join(lines[:100]) + "\t".join(fields) + "".join(lines[101:]))
    line = _main_error(capsys, monkeypatch, ["--data", str(path), "--eval-samples", "10"], 1)
    assert line.startswith(f"sparsekit.train: error: {path}:101: integer feature I1 is too large: ")


def test_malformed_criteo_file_in_a_process_exits_1_without_a_traceback(criteo_files):
    """The real command: status 1, and stderr is the one line naming file:line."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    broken = str(criteo_files / "broken.tsv")
    completed = subprocess.run([sys.executable, "-m", "sparsekit.train", *TINY_FLAGS, "--data", broken,
                                "--eval-samples", "10"], env=env, capture_output=True, text=True, timeout=300,
                               check=False)
    assert completed.returncode == 1, completed.stderr
    expected = (f"sparsekit.train: error: {broken}:5: expected 40 tab-separated fields (label, 13 integers, "
                "26 categorical), got 2")
    assert completed.stderr.splitlines() == [expected]


def test_os_errors_name_the_path_and_bugs_keep_their_traceback(capsys, monkeypatch):
    """An OSError about a path (unreadable file, full disk) is one line; anything else is a
    bug and propagates from main."""
    from sparsekit.train import __main__

    def unreadable(config):
        raise PermissionError(13, "Permission denied", "/data/day_0.tsv")

    monkeypatch.setattr(__main__, "train", unreadable)
    line = _main_error(capsys, monkeypatch, [], 1)
    assert line == "sparsekit.train: error: [Errno 13] Permission denied: '/data/day_0.tsv'"
    for bug in (KeyError("config"), OSError("no path"), ValueError("a bug")):
        def buggy(config, bug=bug):
            raise bug

        monkeypatch.setattr(__main__, "train", buggy)
        with pytest.raises(type(bug)):
            __main__.main(TINY_FLAGS)


@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory):
    """One-step checkpoints of the TINY_FLAGS run, per embedding back end."""
    from sparsekit.train.__main__ import parse_args

    root = tmp_path_factory.mktemp("saved")
    for embedding in EMBEDDINGS:
        train(parse_args(TINY_FLAGS + ["--embedding", embedding, "--steps", "1",
                                       "--checkpoint-dir", str(root / embedding)]))
    return root


def _damage_latest(content):
    def damage(directory):
        (directory / "LATEST").write_bytes(content)
    return damage


def _replace_model_blob(change):
    """The torch baseline's optimizer.pt, changed in place by ``change``."""
    def damage(directory):
        path = directory / "ckpt-000001" / "optimizer.pt"
        blob = torch.load(path, weights_only=True)
        change(blob)
        torch.save(blob, path)
    return damage


def _replace_trainer_state(change):
    def damage(directory):
        path = directory / "ckpt-000001" / "trainer_rank0.pt"
        torch.save(change(torch.load(path, weights_only=True)), path)
    return damage


@pytest.mark.parametrize("embedding, damage, message", [
    ("sparsekit", _damage_latest(b"\x89\xfe\x00garbage\xff\n"), "LATEST holds b'\\x89\\xfe\\x00garbage"),
    ("sparsekit", _damage_latest(b""), "LATEST is empty"),
    ("sparsekit", _damage_latest(b"  \n"), "LATEST is empty"),
    ("sparsekit", _damage_latest(b"../elsewhere\n"),
     "LATEST holds b'../elsewhere\\n', not a checkpoint's name"),
    ("sparsekit", _damage_latest(b"ckpt-000007\n"), "LATEST names ckpt-000007, but"),
    ("sparsekit", lambda d: (d / "ckpt-000001" / "trainer_rank0.pt").unlink(), "has no trainer_rank0.pt"),
    ("sparsekit", lambda d: (d / "ckpt-000001" / "trainer_rank0.pt").write_bytes(b""),
     "trainer_rank0.pt (it is empty); the checkpoint is damaged"),
    ("sparsekit", lambda d: (d / "ckpt-000001" / "trainer_rank0.pt").write_bytes(b"\x00\x01not torch"),
     "cannot read"),
    ("sparsekit", lambda d: torch.save({"foo": 1}, d / "ckpt-000001" / "trainer_rank0.pt"),
     "trainer_rank0.pt lacks 'step', 'config', 'cpu_rng'"),
    ("sparsekit", lambda d: torch.save([1, 2], d / "ckpt-000001" / "trainer_rank0.pt"),
     "trainer_rank0.pt holds a list, not the trainer state"),
    ("sparsekit", _replace_trainer_state(lambda state: {**state, "step": -3}),
     "trainer_rank0.pt holds step -3, not an integer >= 0"),
    ("sparsekit", _replace_trainer_state(lambda state: {**state, "cpu_rng": torch.zeros(3)}),
     "holds no valid CPU RNG state"),
    ("sparsekit", _replace_trainer_state(lambda state: {**state, "config": {**state["config"], "seed": 5}}),
     "was written with --seed 5 (now 0)"),
    ("sparsekit", lambda d: (d / "ckpt-000001" / "metadata.json").unlink(),
     "metadata.json is missing; the checkpoint is incomplete"),
    ("torch", lambda d: (d / "ckpt-000001" / "optimizer.pt").unlink(), "has no optimizer.pt"),
    ("torch", lambda d: torch.save({}, d / "ckpt-000001" / "optimizer.pt"),
     "optimizer.pt does not fit the optimizer (ValueError: the sparse optimizer's state is a NoneType"),
    ("torch", lambda d: torch.save({"format": 1, "model": {}, "optimizer": None}, d / "ckpt-000001" / "dense.pt"),
     "load_checkpoint: dense state keys differ"),
    ("torch", lambda d: torch.save([1], d / "ckpt-000001" / "optimizer.pt"),
     "optimizer.pt does not fit the optimizer (ValueError: the sparse optimizer's state is a NoneType"),
    # Optimizer states torch's own load takes, and the first step then failed on with a traceback.
    ("torch", _replace_model_blob(lambda blob: blob["dense"]["state"][0].update(exp_avg=torch.zeros(3))),
     "the dense optimizer's state holds exp_avg (3,) for a parameter of shape"),
    ("torch", _replace_model_blob(lambda blob: blob.update(sparse=5, dense=5)),
     "the sparse optimizer's state is a int, not a dict with 'state' and 'param_groups'"),
    ("torch", _replace_model_blob(lambda blob: blob["dense"]["param_groups"][0].update(lr="0.1")),
     "the dense optimizer's state holds lr='0.1', not a number"),
])
def test_resume_from_a_damaged_checkpoint_is_one_line_naming_it(capsys, monkeypatch, tmp_path,
                                                                saved_checkpoints, embedding, damage, message):
    directory = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoints / embedding, directory)
    damage(directory)
    line = _main_error(capsys, monkeypatch, ["--embedding", embedding, "--checkpoint-dir", str(directory),
                                             "--resume"], 1)
    assert line.startswith("sparsekit.train: error: --resume: ") and str(directory) in line
    assert message in line


def test_resume_from_the_saved_checkpoints_works(saved_checkpoints, tmp_path):
    """The fixture's checkpoints are good: the damage is what the test above reports."""
    from sparsekit.train.__main__ import parse_args

    for embedding in EMBEDDINGS:
        shutil.copytree(saved_checkpoints / embedding, tmp_path / embedding)
        result = train(parse_args(TINY_FLAGS + ["--embedding", embedding, "--checkpoint-dir",
                                                str(tmp_path / embedding), "--resume"]))
        assert result["resumed_from_step"] == 1 and result["steps"] == 2


def test_help_states_the_bounds(capsys):
    from sparsekit.train.__main__ import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for bound in ("at most 1,048,576", "0 <= seed < 2^63", "> 0 and at most 1 ", "(at most 4,194,304)",
                  "With --data synthetic at most 4,194,304", "with --data FILE", "(at most 604800, a week)"):
        assert bound in text, bound
    assert "(default: None)" not in text and "(default: True)" not in text


def _fail_and_stay(rank: int, world_size: int, port: int, timeout: float, results, started) -> None:
    """Rank 1 fails before a collective and stays alive; rank 0 must not wait for ever."""
    import time

    import torch.distributed as dist

    from sparsekit.train.loop import setup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # The group forms within `timeout` (2 s) or not at all: both ranks start it together,
    # whatever their imports took (seconds apart on a machine busy with other tests).
    started.wait(timeout=120)
    setup("cpu", timeout)
    start = time.monotonic()
    if rank == 1:
        time.sleep(3 * timeout)
    else:
        try:
            dist.all_reduce(torch.ones(1))
            results.put(("no error", time.monotonic() - start))
        except Exception as error:  # noqa: BLE001 (gloo raises RuntimeError or DistBackendError)
            results.put((type(error).__name__, time.monotonic() - start))


@pytest.mark.distributed
def test_timeout_bounds_a_rank_that_fails_and_stays():
    """--timeout reaches the process group: the waiting rank raises after about that long."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    started = context.Barrier(2)
    procs = [context.Process(target=_fail_and_stay, args=(rank, 2, port, 2.0, results, started))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    outcome, seconds = results.get(timeout=60)
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert outcome != "no error"
    assert seconds < 30


def _torchrun(config: TrainConfig, nproc: int, metrics_path: str) -> dict:
    """Run ``config`` under torchrun on ``nproc`` CPU processes (gloo); rank 0's metrics."""
    args = ["--device", "cpu", "--embedding", config.embedding, "--steps", str(config.steps),
            "--batch-size", str(config.batch_size), "--eval-samples", str(config.eval_samples),
            "--eval-every", str(config.eval_every), "--embedding-dim", str(config.embedding_dim),
            "--table-rows", str(config.table_rows), "--vocab-per-slot", str(config.vocab_per_slot),
            "--lr", str(config.lr), "--no-progress", "--metrics-json", metrics_path]
    args += ["--tables", config.tables, "--embedding-dtype", config.embedding_dtype]
    if config.checkpoint_dir:
        args += ["--checkpoint-dir", config.checkpoint_dir]
    if config.resume:
        args.append("--resume")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "sparsekit.train", *args]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    with open(metrics_path) as metrics:
        return json.load(metrics)


@pytest.mark.distributed
def test_an_error_on_one_rank_ends_every_rank_with_one_line(tmp_path):
    """Under torchrun a bad line read by one rank only: that rank names the file and line,
    the other one says its collective failed because a peer stopped; neither prints a
    traceback of its own (torchrun's launcher reports the failed child with its own)."""
    path = str(tmp_path / "day.tsv")
    write_synthetic_tsv(path, 3000, seed=0)
    with open(path) as source:
        lines = source.readlines()
    lines[100] = "2" + lines[100][1:]  # line 101: a label that is neither 0 nor 1
    with open(path, "w") as out:
        out.writelines(lines)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "sparsekit.train", "--device", "cpu", "--no-progress", "--eval-every", "0", "--steps", "4",
               "--batch-size", "64", "--eval-samples", "128", "--table-rows", "20000", "--timeout", "60",
               "--data", path]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode != 0
    errors = [line for line in completed.stderr.splitlines() if "sparsekit.train: error:" in line]
    assert len(errors) == 2, completed.stderr[-3000:]
    assert any("day.tsv:101: label must be 0 or 1" in line for line in errors), errors
    assert any("a collective with the other ranks failed" in line and "another rank stopped" in line
               for line in errors), errors
    # No traceback through the package's own files (the checkout's name may be "sparsekit" too).
    package = os.path.dirname(os.path.abspath(sk.__file__)) + os.sep
    assert f'File "{package}' not in completed.stderr, completed.stderr[-3000:]


@pytest.mark.distributed
def test_a_trainer_file_that_fails_on_one_rank_is_shared_with_the_others(tmp_path):
    """The trainer_rankR.pt part of a checkpoint, saved or read on one rank only, failed
    there alone: the other rank went on into its next collective and reported a peer that
    vanished (gloo's "Connection reset by peer") instead of docs/design.md's OtherRankError line."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    directory = tmp_path / "ckpt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "sparsekit.train", "--device", "cpu", "--no-progress", "--eval-every", "0", "--steps", "2",
               "--batch-size", "64", "--eval-samples", "128", "--table-rows", "20000", "--timeout", "60",
               "--checkpoint-dir", str(directory)]

    def errors_of(args):
        completed = subprocess.run(command + args, env=env, capture_output=True, text=True, timeout=300)
        assert completed.returncode != 0
        errors = [line for line in completed.stderr.splitlines() if "sparsekit.train: error:" in line]
        assert len(errors) == 2, completed.stderr[-3000:]
        assert any("rank 0: " in line and "failed on another rank" in line for line in errors), errors
        return errors

    # Saving it rides in sparsekit.save_checkpoint, whose failures on one rank
    # tests/checkpoint/test_checkpoint.py covers. Resume: rank 1's trainer file is damaged.
    subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True)
    (directory / "ckpt-000002" / "trainer_rank1.pt").write_text("garbage")
    errors = errors_of(["--steps", "4", "--resume"])
    assert any("trainer_rank1.pt" in line and "damaged" in line for line in errors), errors


@pytest.mark.distributed
@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_two_processes_match_one_process(tmp_path, embedding):
    """torchrun, 2 ranks on gloo, same global batches: DDP over the dense layers plus the
    model-parallel sparsekit embedding (or the replicated torch one) follows the
    one-process run up to float summation order."""
    single = train(tiny(embedding=embedding))
    double = _torchrun(tiny(embedding=embedding), 2, str(tmp_path / "metrics.json"))
    _check_metrics(double, steps=single["steps"], world_size=2)
    assert double["eval_samples"] == single["eval_samples"]
    assert double["auc"] == pytest.approx(single["auc"], abs=2e-3)
    assert double["logloss"] == pytest.approx(single["logloss"], abs=2e-3)


@pytest.mark.distributed
def test_per_slot_tables_on_two_processes_match_one_process(tmp_path):
    """The collection's fused exchange under torchrun: 2 ranks follow the one-process run."""
    single = train(tiny(tables="per-slot", embedding_dtype="bf16"))
    double = _torchrun(tiny(tables="per-slot", embedding_dtype="bf16"), 2, str(tmp_path / "metrics.json"))
    _check_metrics(double, steps=single["steps"], world_size=2)
    assert double["auc"] == pytest.approx(single["auc"], abs=2e-3)
    assert double["logloss"] == pytest.approx(single["logloss"], abs=2e-3)


@pytest.mark.distributed
def test_resume_on_another_world_size(tmp_path):
    """Checkpoint on 1 process, resume on 2: the run ends where the uninterrupted one does."""
    straight = train(tiny(embedding="sparsekit"))
    # Another rank's trainer file of an earlier run on 2 ranks with other settings, in the
    # checkpoint the next run writes: the save replaces the whole checkpoint (a resume on 2
    # ranks read it as this checkpoint's and refused "--embedding-dim 8 (now ...)").
    step_dir = tmp_path / "ckpt-000005"
    step_dir.mkdir()
    stale = tmp_path / "stale_rank1.pt"
    torch.save({"step": 5, "config": {"embedding_dim": 8}, "world_size": 2, "cpu_rng": torch.get_rng_state()}, stale)
    shutil.copy(stale, step_dir / "trainer_rank1.pt")
    train(tiny(embedding="sparsekit", steps=5, checkpoint_dir=str(tmp_path)))
    assert sorted(os.listdir(step_dir)) == ["dense.pt", "metadata.json", "shard-00000-of-00001.pt",
                                            "trainer_rank0.pt"]
    # One left by an older version, which did not remove them: rank 0's file says one rank
    # wrote the checkpoint, so rank 1 does not read it.
    shutil.copy(stale, step_dir / "trainer_rank1.pt")
    resumed = _torchrun(tiny(embedding="sparsekit", checkpoint_dir=str(tmp_path), resume=True), 2,
                        str(tmp_path / "metrics.json"))
    assert resumed["resumed_from_step"] == 5 and resumed["world_size"] == 2
    assert resumed["auc"] == pytest.approx(straight["auc"], abs=2e-3)
    assert resumed["logloss"] == pytest.approx(straight["logloss"], abs=2e-3)


def test_an_undefined_score_is_null_in_the_result_json(tmp_path):
    """One held-out sample has one class: its AUC is undefined, written as null (strict JSON)."""
    path = tmp_path / "metrics.json"
    result = train(tiny(batch_size=1, eval_samples=1, steps=2, eval_every=0, metrics_json=str(path)),
                   log=lambda *_: None)
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    written = json.loads(path.read_text(), parse_constant=refuse)
    assert result["auc"] is None and written["auc"] is None and written["logloss"] is not None


def test_resuming_past_steps_says_there_is_nothing_to_train(tmp_path):
    train(tiny(steps=4, checkpoint_dir=str(tmp_path)), log=lambda *_: None)
    lines = []
    result = train(tiny(steps=2, checkpoint_dir=str(tmp_path), resume=True), log=lines.append)
    assert result["steps"] == 4 and result["resumed_from_step"] == 4
    assert any("nothing to train: the checkpoint is at step 4, --steps is 2" in line for line in lines), lines


def test_results_written_to_a_special_file_or_through_a_link_leave_it_in_place(tmp_path):
    """--metrics-json /dev/null (or /dev/stdout) was written to a temporary file renamed onto
    it: as root that replaced the machine's /dev/null with a regular file. A path that is no
    regular file is written in place, and a link's file is replaced, not the link."""
    import stat
    import threading

    from sparsekit.train.loop import _atomic_write_text

    link = tmp_path / "null-link"
    link.symlink_to(os.devnull)
    _atomic_write_text(str(link), "discarded\n")
    assert link.is_symlink() and stat.S_ISCHR(os.stat(os.devnull).st_mode)

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    _atomic_write_text(str(fifo), "to the reader\n")
    reader.join(timeout=30)
    assert got == ["to the reader\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)

    target, file_link = tmp_path / "metrics.json", tmp_path / "latest-metrics.json"
    target.write_text("old")
    file_link.symlink_to(target)
    _atomic_write_text(str(file_link), "new\n")
    assert file_link.is_symlink() and target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "latest-metrics.json", "metrics.json", "null-link"]


@pytest.mark.parametrize("environment, message", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT are not set: launch the ranks with torchrun"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "WORLD_SIZE=2 but MASTER_PORT is not set"),
    ({"WORLD_SIZE": "abc"}, "the environment variable WORLD_SIZE='abc' must be a non-negative integer"),
    ({"LOCAL_RANK": "-1"}, "the environment variable LOCAL_RANK='-1' must be a non-negative integer"),
])
def test_a_distributed_environment_set_by_hand_and_wrong_is_one_line(capsys, monkeypatch, environment, message):
    """Run by hand rather than by torchrun: torch's ValueError with its traceback before."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    line = _main_error(capsys, monkeypatch, [], 1)
    assert message in line, line


@pytest.mark.parametrize("where", ["save", "load"])
def test_a_checkpoint_that_failed_on_another_rank_is_one_line(capsys, monkeypatch, tmp_path, where):
    """save_checkpoint / load_checkpoint raise OtherRankError on the ranks whose own part was
    fine: the harness printed its traceback there, one line on the rank that failed."""
    import sparsekit as sk
    from sparsekit.checkpoint import OtherRankError

    directory = str(tmp_path / "ckpt")
    if where == "load":
        from sparsekit.train import __main__

        monkeypatch.setattr(__main__, "keep_freed_memory", lambda: False)
        __main__.main(TINY_FLAGS + ["--checkpoint-dir", directory])

    def other_rank_failed(*args, **kwargs):
        raise OtherRankError(f"{where}_checkpoint failed on another rank (see the error there); nothing was changed "
                             "on this rank")
    monkeypatch.setattr(sk, f"{where}_checkpoint", other_rank_failed)
    line = _main_error(capsys, monkeypatch, ["--checkpoint-dir", directory] + (["--resume"] if where == "load" else []),
                       1)
    assert line == (f"sparsekit.train: error: rank 0: {where}_checkpoint failed on another rank (see the error there); "
                    "nothing was changed on this rank")


def test_a_fresh_run_rewriting_the_step_latest_names_unlinks_it_first(tmp_path, monkeypatch):
    """A fresh run into a directory whose LATEST names the step it saves replaces that
    checkpoint: the pointer goes first, so killed before the new pointer is written, no
    pointer is left (not one at a mix of two runs), and a resume without one, where
    checkpoints are, is refused."""
    from sparsekit.checkpoint import layout
    from sparsekit.train.loop import LATEST, CheckpointError

    directory = str(tmp_path / "ckpt")
    train(tiny(steps=2, eval_every=0, checkpoint_dir=directory))
    assert open(os.path.join(directory, LATEST)).read() == "ckpt-000002"
    original = layout.write_file

    def dies_at_the_pointer(path, write):
        if os.path.basename(path).startswith(LATEST):
            raise KeyboardInterrupt  # killed after the new checkpoint took the old one's place
        original(path, write)
    monkeypatch.setattr(layout, "write_file", dies_at_the_pointer)
    with pytest.raises(KeyboardInterrupt):
        train(tiny(steps=2, eval_every=0, lr=3e-2, checkpoint_dir=directory))
    monkeypatch.setattr(layout, "write_file", original)
    assert not os.path.exists(os.path.join(directory, LATEST))
    with pytest.raises(CheckpointError, match=r"holds checkpoints \(ckpt-000002 .. ckpt-000002\) but no "
                                              r"'LATEST' file"):
        train(tiny(steps=4, eval_every=0, checkpoint_dir=directory, resume=True))


def test_metrics_json_that_is_the_checkpoint_directory_is_refused_before_the_run(tmp_path):
    directory = str(tmp_path / "out")
    with pytest.raises(ValueError, match="--metrics-json .* is --checkpoint-dir itself"):
        tiny(checkpoint_dir=directory, metrics_json=directory).validate()


def test_the_harness_writes_library_checkpoints_that_a_model_only_load_reads(tmp_path):
    """The run's checkpoints are the library's: ckpt-NNNNNN (the step) under LATEST, each
    rank's trainer state inside; sparsekit.load_checkpoint of the model alone reads them."""
    import sparsekit as sk
    from sparsekit.train import loop

    directory = tmp_path / "ckpt"
    config = tiny(steps=3, eval_every=0, checkpoint_every=2, keep_checkpoints=5, checkpoint_dir=str(directory))
    train(config, log=lambda *_: None)
    assert sorted(os.listdir(directory)) == ["LATEST", "ckpt-000002", "ckpt-000003"]
    assert (directory / "LATEST").read_text() == "ckpt-000003"
    assert "trainer_rank0.pt" in os.listdir(directory / "ckpt-000003")
    assert sk.checkpoint.CheckpointDirectory(str(directory)).steps() == [2, 3]
    model, _, _ = loop.build(config, loop.Context(rank=0, world_size=1, device=torch.device("cpu")))
    assert sk.load_checkpoint(str(directory), model).endswith("ckpt-000003")
    assert sk.load_checkpoint(str(directory), model, step=2).endswith("ckpt-000002")


def test_resume_of_the_older_layout_is_one_line_saying_how_to_proceed(capsys, monkeypatch, tmp_path):
    """A directory of the older harness layout (latest + step_NNNNNNNNN/) is not resumed:
    one line names it and says what to do; a fresh run into it writes the new layout."""
    directory = tmp_path / "old"
    (directory / "step_000000004" / "model").mkdir(parents=True)
    (directory / "latest").write_text("step_000000004\n")
    line = _main_error(capsys, monkeypatch, ["--checkpoint-dir", str(directory), "--resume"], 1)
    assert line.startswith(f"sparsekit.train: error: --resume: {directory} holds checkpoints of the older layout")
    assert "start a fresh --checkpoint-dir" in line
