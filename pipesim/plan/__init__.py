"""Studies over many simulated steps: the layout search behind ``pipesim plan`` (a
``PlanRequest`` checked in ``request``, its layouts in ``layouts``, each evaluated by a
``LayoutEvaluator`` in ``evaluate``, searched in ``search``) and schedule sweeps
(``sweep``). Every step they score is the one ``sim`` computes for the same inputs."""
