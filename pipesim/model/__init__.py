"""The model being trained and what its stages cost: transformer specs and Hugging Face
configs (``spec``, ``hf_config``), FLOPs, activation and memory traffic
(``activations``, ``memory_traffic``), and the per-stage ``Costs`` the simulation
consumes (``costs``, derived by ``transformer_costs``). Imports nothing above it."""
