"""The typed micro-batch (algorithms/micro_batch.py) through the step's host paths: stacking the
batch shards' parts and packing rows keep every field in its place (terms included), and a row
field that declares no side is refused. Expected values are hand-written."""
from typing import Any

import numpy as np
import pytest

from ctopd_jax.algorithms.micro_batch import MicroBatch, rows, terms_class
from ctopd_jax.algorithms.packed_rows import PackingError, pack_rows
from ctopd_jax.algorithms.strict import StrictPairs
from ctopd_jax.step.shards import stack_shards


def tokens(lengths, width=64):
    mask = np.arange(width)[None] < np.asarray(lengths)[:, None]
    return np.where(mask, 7, 0).astype(np.int32), mask


def test_stacked_shards_keep_every_field_in_place():
    """Two shards with 2 and 3 strict pairs: each field is padded to the larger part and
    concatenated, shard s owning block s; absent fields stay absent."""
    def part(n_pairs, first):
        ids, mask = tokens([3])
        pairs = StrictPairs(strict_student_rows=np.arange(first, first + n_pairs, dtype=np.int32),
                            strict_teacher_rows=np.arange(n_pairs, dtype=np.int32),
                            strict_weight=np.ones(n_pairs, np.float32))
        return MicroBatch(student_ids=ids, student_mask=mask, response_rows=np.array([1, 2], np.int32),
                          teacher_rows=pairs.strict_teacher_rows, terms=pairs)

    out = stack_shards([part(2, 10), part(3, 20)])
    assert isinstance(out, MicroBatch) and isinstance(out.terms, StrictPairs)
    assert out.terms.strict_student_rows.tolist() == [10, 11, 0, 20, 21, 22]
    assert out.terms.strict_weight.tolist() == [1, 1, 0, 1, 1, 1]
    assert out.teacher_rows.tolist() == [0, 1, 0, 0, 1, 2]
    assert out.response_rows.tolist() == [1, 2, 1, 2]
    assert out.student_ids.shape == (2, 64)
    assert out.teacher_ids is None and out.base_hidden is None


def test_stacked_shards_of_different_widths_keep_each_row_on_its_token():
    """Shard parts prepared on their own have their own widths (64 and 128 here: samples in
    different length buckets). After stacking, every declared row of a part still indexes the
    token it indexed in that part (token ids are unique, so the oracle is the token itself)."""
    def part(lengths, width, first_id):
        mask = np.arange(width)[None] < np.asarray(lengths)[:, None]
        ids = np.where(mask, first_id + np.arange(mask.size).reshape(mask.shape), 0).astype(np.int32)
        flat = np.flatnonzero(mask.reshape(-1)).astype(np.int32)
        pairs = StrictPairs(strict_student_rows=flat[::2], strict_teacher_rows=flat[1::2],
                            strict_weight=np.ones(len(flat[::2]), np.float32))
        return MicroBatch(student_ids=ids, student_mask=mask, response_rows=flat, teacher_ids=ids + 1,
                          teacher_mask=mask, teacher_rows=flat[1::2], terms=pairs)

    parts = [part([5, 60], 64, 1000), part([100, 3], 128, 5000)]
    out = stack_shards(parts)
    assert out.student_ids.shape == (4, 128) and out.teacher_mask.shape == (4, 128)

    def tokens(ids, rows, shard=None):
        """The tokens at `rows`: of a part, or of shard `shard`'s block of the stacked batch (its
        2 samples, and its block of the rows, padded to the larger part's count)."""
        if shard is None:
            return ids.reshape(-1)[rows].tolist()
        block = len(rows) // len(parts)
        return ids[2 * shard:2 * shard + 2].reshape(-1)[rows[shard * block:(shard + 1) * block]].tolist()

    for shard, p in enumerate(parts):
        for field in ("response_rows", "teacher_rows"):
            ids = "student_ids" if field == "response_rows" else "teacher_ids"
            got = tokens(getattr(out, ids), getattr(out, field), shard)
            assert got[:len(getattr(p, field))] == tokens(getattr(p, ids), getattr(p, field))
        got = tokens(out.student_ids, out.terms.strict_student_rows, shard)
        assert got[:len(p.terms.strict_student_rows)] == tokens(p.student_ids, p.terms.strict_student_rows)


def test_packed_rows_move_the_declared_rows_of_the_terms():
    """Student lengths 3, 1, 4 -> one row of 16 at offsets 0, 3, 4; teacher lengths 2, 2, 2 ->
    one row of 16 at offsets 0, 2, 4. Row fields of both sides move, weights do not."""
    s_ids, s_mask = tokens([3, 1, 4])
    t_ids, t_mask = tokens([2, 2, 2])
    pairs = StrictPairs(strict_student_rows=np.array([1, 64, 130], np.int32),
                        strict_teacher_rows=np.array([0, 65, 129], np.int32),
                        strict_weight=np.array([1, 1, 0], np.float32))
    batch = MicroBatch(student_ids=s_ids, student_mask=s_mask, response_rows=np.array([2, 131], np.int32),
                       response_weight=np.ones(2, np.float32), teacher_ids=t_ids, teacher_mask=t_mask,
                       teacher_rows=pairs.strict_teacher_rows, terms=pairs)
    out = pack_rows(batch, 64)
    assert out.student_mask.shape == (1, 16) and out.teacher_mask.shape == (1, 16)
    assert out.teacher_mask[0, :7].tolist() == [1, 1, 2, 2, 3, 3, 0]
    assert out.response_rows.tolist() == [2, 7]
    assert out.terms.strict_student_rows.tolist() == [1, 3, 6]
    assert out.terms.strict_teacher_rows.tolist() == [0, 3, 5]
    assert out.teacher_rows.tolist() == [0, 3, 5]
    assert out.terms.strict_weight.tolist() == [1, 1, 0] and out.response_weight.tolist() == [1, 1]


@terms_class
class Undeclared:
    student_rows: Any = rows("student")
    other_rows: Any = None   # flat rows with no side: packing cannot know which layout they index


def test_an_undeclared_row_field_is_refused():
    ids, mask = tokens([2, 3])
    batch = MicroBatch(student_ids=ids, student_mask=mask, response_rows=np.zeros(3, np.int32),
                       terms=Undeclared(student_rows=np.zeros(2, np.int32), other_rows=np.zeros(3, np.int32)))
    with pytest.raises(PackingError, match=r"Undeclared\.other_rows"):
        pack_rows(batch, 64)


def test_a_row_field_names_a_known_side():
    with pytest.raises(ValueError, match="side"):
        rows("both")
