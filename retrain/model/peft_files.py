"""The files of a PEFT LoRA adapter directory: what PEFT's save_pretrained writes, and what vLLM, SGLang,
PRIME-RL and `retrain squeeze` read."""

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
