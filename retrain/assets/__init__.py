"""Files shipped inside the package, so the offline quickstart needs no download."""

from pathlib import Path

# A ~1M-parameter Qwen3 and its byte-level tokenizer, warm-started on retrain.data.arithmetic.
# Load with AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR) / AutoTokenizer.from_pretrained(...).
TINY_MODEL_DIR: Path = Path(__file__).resolve().parent / "tiny_qwen3"
