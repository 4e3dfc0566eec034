"""FP8 weight formats: reading FP8 checkpoints, quantizing bf16/fp32 weights at load, dequantizing on CPU.

`fp8_format` parses a checkpoint's `quantization_config` and the `quantization=` setting into a plan;
`fp8_tensor` holds the tensor math (block quantizer, dequantizer, scale layouts); `fp8_loading` rewrites the
checkpoint's tensor stream for the model loaders and converts linear layers to FP8 parameters on CUDA;
`fp8_experts` does the same for DeepSeek's fused routed experts (block-scaled plans).
"""
