"""The architectures ``pipesim run --model`` builds from simulate's presets and Hugging
Face config files, in plain torch: GQA, RoPE, RMSNorm, SwiGLU, mixture-of-experts routing
and latent attention (``layers``, ``moe``, ``latent_attention``), assembled into blocks
(``transformer``) and shrunk to the machine (``build``). The model never knows how it is
parallelised: tensor, context and expert parallelism are applied to it by the executor's
own modules."""
