"""Files shipped inside the package, so the offline quickstart needs no download."""

from pathlib import Path

# A ~1M-parameter Qwen3 and its byte-level tokenizer, warm-started on retrain.data.arithmetic.
# Load with AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR) / AutoTokenizer.from_pretrained(...).
TINY_MODEL_DIR: Path = Path(__file__).resolve().parent / "tiny_qwen3"

# config.json of models retrain's users train by default, so the memory plan (retrain/model/memory_plan.py)
# and benchmarks/real_scale.py know their shape without a download; the file name is the Hub id's last part.
MODEL_CONFIGS_DIR: Path = Path(__file__).resolve().parent / "model_configs"
