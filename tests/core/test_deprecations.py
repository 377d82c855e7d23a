"""Old argument spellings (core/deprecations.py): mapped to the new with a warning naming both, refused when both
disagree; and, on a real callback, the old spelling still configures it."""

import warnings

import pytest

from lightning_opkit.core.deprecations import OpkitDeprecationWarning, renamed


def test_the_new_spelling_alone_passes_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert renamed("X", "old", None, "new", 5, 1) == 5


def test_the_old_spelling_warns_naming_both_and_gives_its_value():
    with pytest.warns(OpkitDeprecationWarning, match=r"X\(old=\.\.\.\) is deprecated .* use new=\.\.\."):
        assert renamed("X", "old", 7, "new", 1, 1) == 7


def test_both_spellings_with_different_values_are_refused():
    with pytest.raises(ValueError, match=r"X\(old=7, new=3\): `old` is the old name of `new`"):
        renamed("X", "old", 7, "new", 3, 1)
    with pytest.warns(OpkitDeprecationWarning):
        assert renamed("X", "old", 3, "new", 3, 1) == 3  # the same value twice: only the warning


def test_it_is_a_future_warning_so_users_see_it_by_default():
    assert issubclass(OpkitDeprecationWarning, FutureWarning)


def test_a_real_callback_still_takes_its_old_spelling():
    from lightning_opkit import ProfilerWindows

    with pytest.warns(OpkitDeprecationWarning, match=r"ProfilerWindows\(memory=\.\.\.\)"):
        callback = ProfilerWindows(memory=True)
    assert callback.memory_breakdown is True
    assert ProfilerWindows().memory_breakdown is False
