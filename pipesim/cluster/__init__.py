"""The modelled cluster: devices, switches and links (``topology``, built from
``presets`` and ``hierarchy`` or read by ``files``, their GPUs' figures from
``pipesim.hardware``), how ranks map onto devices (``mapping``), what collectives cost on
those links (``collectives``) and the traffic of the pipelines a step does not simulate
(``twins``). Beside ``pipesim.model``, neither importing the other; the simulation reads
both."""
