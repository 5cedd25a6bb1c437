"""A compute order as JSON (``schedules.order_json``), what ``pipesim plan --json`` writes
beside a row whose order it built from costs: it reads back as the same order, and a bad
one is refused naming what is wrong."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import generate, lower
from schedules.order_json import order_from_dict, order_to_dict


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["1f1b", "zb-h1", "zbv", "interleaved-1f1b", "dualpipev"]), pp=st.sampled_from([2, 4]),
       rounds=st.integers(1, 3))
def test_an_order_reads_back_as_itself(name: str, pp: int, rounds: int) -> None:
    chunks = 2 if name in ("zbv", "interleaved-1f1b", "dualpipev") else 1
    schedule = generate(name, pp, 2 * pp * rounds, chunks)
    data = json.loads(json.dumps(order_to_dict(lower(schedule))))  # lowered: the transfers are left out
    back = order_from_dict(data)
    assert back.programs == schedule.programs and back.placement == schedule.placement
    assert (back.pp, back.microbatches, back.name) == (schedule.pp, schedule.microbatches, schedule.name)


def test_a_bad_order_is_refused_naming_what_is_wrong() -> None:
    good = order_to_dict(generate("1f1b", 2, 2))
    with pytest.raises(ValueError, match="^row 3: missing placement"):
        order_from_dict({key: value for key, value in good.items() if key != "placement"}, "row 3")
    with pytest.raises(ValueError, match="one program per rank"):
        order_from_dict({**good, "programs": good["programs"][:1]})
    with pytest.raises(ValueError, match="^order: '0X1' has unknown kind 'X'"):
        order_from_dict({**good, "programs": [["0X1", *good["programs"][0][1:]], good["programs"][1]]})
    dropped = [program[:] for program in good["programs"]]
    dropped[1].remove("1B1")  # microbatch 1 never runs its backward on stage 1
    with pytest.raises(ValueError, match="1B1"):
        order_from_dict({**good, "programs": dropped})
    with pytest.raises(ValueError, match="expected an object"):
        order_from_dict([1, 2])
    with pytest.raises(ValueError, match="^order: a schedule needs at least one microbatch, got -3"):
        order_from_dict({**good, "microbatches": -3})
    with pytest.raises(ValueError, match="^order: "):
        order_from_dict({**good, "placement": ["a", 1]})
