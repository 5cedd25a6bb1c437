"""The model being trained and what its stages cost: transformer specs and Hugging Face
configs (``spec``, ``hf_config``), their mixture-of-experts and latent-attention parts
(``experts``, ``latent_attention``), every layer's weight matrices and what tensor
parallelism does with them (``weights``), which layouts can split the model
(``layout``), FLOPs, activation and memory traffic (``activations``,
``memory_traffic``), and the per-stage ``Costs`` the simulation consumes (``costs``,
derived by ``transformer_costs``). Imports nothing above it."""
