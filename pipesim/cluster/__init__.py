"""The modelled cluster: devices, switches and links (``topology``, built from
``presets`` and ``hierarchy`` or read by ``files``), the GPUs' figures (``gpus``), how
ranks map onto devices (``mapping``), what collectives cost on those links
(``collectives``) and the traffic of the pipelines a step does not simulate
(``twins``). Imports nothing above it: the model and the simulation read it."""
