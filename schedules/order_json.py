"""A compute order as JSON data: each rank's compute actions in program order and which
rank holds each stage, what ``pipesim plan --json`` writes beside a row whose order it
built from the layout's costs (zb-auto, zbv-auto, and the adapted zb-h1 and zb-h2), so
that ``pipesim run --plan FILE --row N`` runs the order the plan simulated rather than
one rebuilt from other costs. The transfers are left out: whoever runs the order lowers
it for its own links (``schedules.lowering``).

    {"name": "zbv-auto", "pp": 2, "microbatches": 4,
     "placement": [0, 1, 1, 0],
     "programs": [["0F0", "0F1", ...], ["1F0", ...]]}
"""

from __future__ import annotations

from schedules.action import ActionParseError, parse_action
from schedules.schedule import Schedule
from schedules.validate import validate

FIELDS = ("name", "pp", "microbatches", "placement", "programs")


def order_to_dict(schedule: Schedule) -> dict:
    """``schedule``'s compute order (its transfers, if lowered, left out) as JSON data."""
    return {"name": schedule.name, "pp": schedule.pp, "microbatches": schedule.microbatches,
            "placement": list(schedule.placement),
            "programs": [[str(action) for action in program if action.is_compute] for program in schedule.programs]}


def order_from_dict(data: dict, where: str = "order") -> Schedule:
    """The compute-only ``Schedule`` ``data`` describes, validated (every microbatch of
    every stage runs once on its rank, in an order that can complete); a ``ValueError``
    naming ``where`` and the field, or the action, that is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object with {', '.join(FIELDS)}, got {type(data).__name__}")
    missing = [name for name in FIELDS if name not in data]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    programs = data["programs"]
    if not isinstance(programs, list) or len(programs) != data["pp"]:
        raise ValueError(f"{where}: programs must list one program per rank ({data['pp']})")
    try:
        parsed = [[parse_action(text) for text in program] for program in programs]
        schedule = Schedule(pp=int(data["pp"]), microbatches=int(data["microbatches"]),
                            placement=tuple(int(rank) for rank in data["placement"]), programs=parsed,
                            name=str(data["name"]))
        validate(schedule)
    except (ActionParseError, TypeError, ValueError) as error:  # the field or action named, in one line
        raise ValueError(f"{where}: {error}") from None
    return schedule
