"""Studies over many simulated steps: the layout search behind ``pipesim plan``
(``search``) and schedule sweeps (``sweep``). Every step they score is the one ``sim``
computes for the same inputs."""
