"""The vocabulary of pipeline schedules: actions, schedules, lowering, validation,
generators, CSV interop and the Trace timeline format.

Depends on networkx and numpy only (programs and timelines are read as arrays), so every
other part of pipesim (the simulator, the torch executor, the charts) can share it
without pulling in each other's dependencies. The timing engine every part asks
(``schedules.engine``) lives here for that reason: lowering and validation need it; so
does its SimPy specification (``schedules.engine_reference``, the one module here that
imports simpy; the engine loads it only where nothing was compiled), so that nothing
here imports upward.
"""

from schedules.action import (
    ALL_KINDS,
    COMM_KINDS,
    COMPUTE_KINDS,
    Action,
    ActionKind,
    ActionParseError,
    parse_action,
)
from schedules.csv_io import ScheduleCsvError, schedule_from_csv, schedule_to_csv
from schedules.generators import GENERATORS, ScheduleUnavailableError, UnknownScheduleError, generate
from schedules.graph import dependency_graph
from schedules.lowering import lower
from schedules.metrics import RankMetrics, StepMetrics, makespan, peak_inflight, step_metrics
from schedules.schedule import Schedule, looped_placement, v_shape_placement
from schedules.trace import Trace, TraceEvent
from schedules.validate import ScheduleValidationError, is_valid, validate

__all__ = [
    "ALL_KINDS",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "GENERATORS",
    "Action",
    "ActionKind",
    "ActionParseError",
    "RankMetrics",
    "Schedule",
    "ScheduleCsvError",
    "ScheduleUnavailableError",
    "ScheduleValidationError",
    "StepMetrics",
    "Trace",
    "TraceEvent",
    "UnknownScheduleError",
    "dependency_graph",
    "generate",
    "is_valid",
    "parse_action",
    "looped_placement",
    "lower",
    "makespan",
    "peak_inflight",
    "schedule_from_csv",
    "schedule_to_csv",
    "step_metrics",
    "v_shape_placement",
    "validate",
]
