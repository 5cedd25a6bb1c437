"""The model being trained and what its stages cost: transformer specs and Hugging Face
configs (``spec``, ``hf_config``), their mixture-of-experts and latent-attention parts
(``experts``, ``latent_attention``), every layer's weight matrices and what tensor
parallelism does with them (``weights``), the operations a layer runs, read off those
matrices (``operations``), which layouts can split the model (``layout``), activation
memory and memory traffic (``activations``, ``memory_traffic``), the compute model that
times the operations on a GPU (``compute_model``, ``gemm_model``, ``attention_model``),
and the per-stage ``Costs`` the simulation consumes (``costs``, derived by
``transformer_costs``). Imports nothing above it."""
