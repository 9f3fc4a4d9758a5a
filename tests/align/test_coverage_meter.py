"""Per-batch and cumulative coverage (SPEC §2) against counts from the oracle."""
from _align_oracle import make_batch, strict_oracle
from ctopd_jax.align import CoverageMeter, strict_align

BATCHES = [
    [([b"ab", b"c"], [b"a", b"bc"], [True, True], [True, True]),   # one 2:2 group -> EOS only
     ([b"x", b"y"], [b"x", b"y"], [True, True], [True, True])],   # two pairs + EOS
    [([b"hello"], [b"hell", b"o"], [True], [True, True]),
     ([b"q"], [b"r"], [True], [True])],                            # byte mismatch
]


def test_coverage_meter_matches_oracle_counts():
    meter = CoverageMeter()
    pairs = s_tokens = t_tokens = mismatched = 0
    for samples in BATCHES:
        teacher, student = make_batch(samples)
        stats = meter.update(strict_align(teacher, student))
        batch_pairs = sum(len(r[0]) + 1 for r in (strict_oracle(*x) for x in samples) if r)
        batch_s = sum(len(x[1]) + 1 for x in samples)
        batch_t = sum(len(x[0]) + 1 for x in samples)
        pairs, s_tokens, t_tokens = pairs + batch_pairs, s_tokens + batch_s, t_tokens + batch_t
        mismatched += sum(strict_oracle(*x) is None for x in samples)
        assert stats["coverage_student"] == batch_pairs / batch_s
        assert stats["coverage_teacher"] == batch_pairs / batch_t
        assert stats["coverage_student_cum"] == pairs / s_tokens
        assert stats["coverage_teacher_cum"] == pairs / t_tokens
        assert stats["byte_mismatch_samples_cum"] == mismatched
    assert mismatched == 1 and pairs == 1 + 3 + 1
