"""Refusal assertions shared by the loader tests."""
import pytest


def refused(fn, err, *names):
    """fn raises err as one line naming every one of names; returns that line."""
    with pytest.raises(err) as e:
        fn()
    line = str(e.value)
    assert "\n" not in line
    for n in names:
        assert n in line, line
    return line
