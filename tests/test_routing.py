"""Rows pick their teacher by a field or the default; bad names and unknown teachers are one
line naming the entry or the row."""
import pytest

from ctopd_jax.common.routing import check_teacher_names, route_rows, row_teachers


def test_rows_route_by_field_or_default():
    rows = [{"prompt": "a", "teacher": "code"}, {"prompt": "b"}, {"prompt": "c", "teacher": "math"},
            {"prompt": "d", "teacher": "code"}]
    assert route_rows(rows, ("math", "code", "chem"), default="math") == {
        "math": [1, 2], "code": [0, 3], "chem": []}
    assert row_teachers(rows, ("math", "code", "chem"), default="math") == ["code", "math", "math", "code"]


@pytest.mark.parametrize("rows, default, message", [
    ([{"teacher": "math"}, {"teacher": "physics"}], "math",
     "data row 1: teacher 'physics' is not one of the teachers (math, code); add it under "
     "teachers: or fix the row"),
    ([{"teacher": "math"}, {"prompt": "x"}], None,
     "data row 1: no 'teacher' field and no default teacher; add the field or set the default"),
])
def test_unknown_teacher_names_the_row(rows, default, message):
    with pytest.raises(ValueError) as info:
        route_rows(rows, ("math", "code"), default=default)
    assert str(info.value) == message


@pytest.mark.parametrize("names, default, message", [
    ([], None, "teachers: the list is empty"),
    (["math", "math"], None, "teachers[1].name: 'math' is used twice"),
    (["math", "2code"], None, "teachers[1].name: '2code' is not a name"),
    (["math", ""], None, "teachers[1].name: '' is not a name"),
    (["math", "code"], "chem", "data.default_teacher: 'chem' is not one of the teachers (math, code)"),
])
def test_bad_teacher_names(names, default, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        check_teacher_names(names, default)
    assert check_teacher_names(["math", "code-v2", "_x"], "math") == ("math", "code-v2", "_x")
