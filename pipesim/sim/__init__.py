"""One simulated step: the engine that times lowered programs on a cluster
(``engine``), the tensor- and data-parallel work around the pipeline (``parallel``),
memory over the step (``memory``) and the whole pass from schedule to metrics
(``step``). Reads ``cluster`` and ``model``; the planner and the API sit above it."""
