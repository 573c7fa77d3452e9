"""The shared argument checks (loco_jax.checks): whole numbers, never bools, with the value named."""

import numpy as np
import pytest

from loco_jax import checks, diloco, loco


@pytest.mark.parametrize("value", [1, 7, np.int32(3), np.int64(2**40)])
def test_integers_pass(value):
    assert checks.is_int(value)
    checks.require_int("n", value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, "2", None, np.float32(1)])
def test_bools_floats_strings_and_none_are_not_integers(value):
    assert not checks.is_int(value)
    with pytest.raises(ValueError, match=r"^n=.* must be a positive integer\.$"):
        checks.require_int("n", value)


def test_the_minimum_none_and_the_message_are_the_callers():
    checks.require_int("k", 0, "an integer >= 0", minimum=0)
    checks.require_int("k", None, allow_none=True)
    with pytest.raises(ValueError, match=r"^k=-1 must be an integer >= 0\.$"):
        checks.require_int("k", -1, "an integer >= 0", minimum=0)


def test_a_bool_where_a_count_belongs_is_refused_by_name():
    """True is an int in Python; before the shared check loco.compress took reset_every=True as 1."""
    with pytest.raises(ValueError, match="reset_every=True must be a positive integer number of steps"):
        loco.compress(bits=4, reset_every=True)
    with pytest.raises(ValueError, match="sync_every=True must be a positive integer"):
        diloco.diloco(loco.compress(bits=None), sync_every=True)
