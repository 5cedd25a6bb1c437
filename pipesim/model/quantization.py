"""A Hugging Face config's ``quantization_config``: what precision the GEMMs train in.

Never ignored. Read:

- ``quant_method: fp8`` (DeepSeek-V3 and R1: ``fmt: e4m3``, ``weight_block_size: [128,
  128]``, ``activation_scheme: dynamic``; the weights were trained and are stored in FP8
  with a scale per 128 x 128 block, activations scaled per 1 x 128 tile): the weight
  GEMMs run in FP8 (``ModelSpec.fp8``, the same as ``--fp8``; the compute model prices
  the GEMMs and their casts). A ``fmt`` other than FP8's two formats is refused. With
  ``weight_block_size`` (block-scaled, DeepSeek-V3's recipe) the MoE all-to-all that feeds
  the experts' FP8 GEMMs carries FP8 too (``ModelSpec.fp8_dispatch``, section 3.3.3 of
  the report: the activation before the up-projections and the gradient before the
  down-projections are quantized, then dispatched; the combines stay BF16).

Refused, with the reason:

- ``mxfp4`` (gpt-oss's experts): weights stored in 4-bit microscaling blocks, which
  pipesim does not train in; training dequantizes them to BF16 (transformers'
  ``Mxfp4Config(dequantize=True)``), so remove the key to simulate that;
- every other method (bitsandbytes, GPTQ, AWQ, ...): quantization for inference, not a
  training precision.
"""

from __future__ import annotations

from pipesim.model.errors import ModelSpecError

FP8_FORMATS = ("e4m3", "e5m2", "hybrid")
# DeepSeek-V3's activation tiles (section 3.3.1): one scale per 1 x 128 elements, counted as
# the FP32 DeepEP's FP8 dispatch carries (``[tokens, hidden // 128]`` of torch.float) and
# Transformer Engine's blockwise recipe stores; DeepSeek's are powers of 2, which an 8-bit
# exponent would hold, but no stack sends them so
FP8_TILE = 128
FP8_SCALE_BYTES = 4
FP8_TILE_BYTES = 1 + FP8_SCALE_BYTES / FP8_TILE  # an FP8 element and its share of its tile's scale
# what the MoE all-to-all toward the experts carries (--ep-dispatch): FP8 with the tiles'
# scales, DeepSeek-V3's and DeepEP's FP8 dispatch; or BF16, the activations' own precision,
# as Megatron-Core's dispatchers send it even under FP8 GEMMs
EP_DISPATCHES = ("fp8", "bf16")
TRAINING_DEQUANTIZED = {
    "mxfp4": "its MXFP4 weights are dequantized to BF16 for training (transformers' Mxfp4Config(dequantize=True)) "
             "and pipesim does not train in 4 bits: remove quantization_config to simulate BF16 training",
}


def gemms_in_fp8(data: dict, name: str) -> bool:
    """Whether ``data``'s ``quantization_config`` trains the GEMMs in FP8 (False when it
    has none); any other quantization is a ``ModelSpecError`` naming the method."""
    quantization = data.get("quantization_config")
    if not quantization:
        return False
    if not isinstance(quantization, dict):
        raise ModelSpecError(f"{name}: quantization_config must be an object with quant_method, got {quantization!r}")
    method = quantization.get("quant_method")
    if method == "fp8":
        form = quantization.get("fmt", "e4m3")
        if form not in FP8_FORMATS:
            raise ModelSpecError(f"{name}: quantization_config fmt {form!r} is not an FP8 format "
                                 f"({', '.join(FP8_FORMATS)})")
        return True
    if method in TRAINING_DEQUANTIZED:
        raise ModelSpecError(f"{name}: quantization_config quant_method {method!r}: {TRAINING_DEQUANTIZED[method]}")
    raise ModelSpecError(f"{name}: quantization_config quant_method {method!r} is quantization for inference, not a "
                         f"training precision pipesim models (it reads fp8, DeepSeek-V3's); remove the key to "
                         f"simulate BF16 training")


def dispatches_in_fp8(data: dict, name: str) -> bool:
    """Whether ``data``'s ``quantization_config`` is DeepSeek-V3's block-scaled FP8 recipe
    (``quant_method: fp8`` with ``weight_block_size``), under which the MoE dispatch is sent
    in FP8 (``ModelSpec.fp8_dispatch``). A per-tensor FP8 config (no block size) trains as
    Transformer Engine's recipes do, which Megatron-Core runs with a BF16 dispatch."""
    if not gemms_in_fp8(data, name):
        return False
    return bool(data["quantization_config"].get("weight_block_size"))
