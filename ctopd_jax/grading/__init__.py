"""Math answer grading (SPEC §10): extraction, normalisation, bounded equivalence.

    from ctopd_jax.grading import MathGrader
    with MathGrader(timeout_s=5.0) as grader:
        result = grader.grade(response, "\\frac{1}{2}")   # GradeResult(extracted, correct, method)
"""
from ctopd_jax.grading.extract import extract_answer, last_boxed
from ctopd_jax.grading.grader import GradeResult, MathGrader, reference_answer
from ctopd_jax.grading.normalize import normalize_answer

__all__ = [
    "GradeResult", "MathGrader", "extract_answer", "last_boxed", "normalize_answer",
    "reference_answer",
]
