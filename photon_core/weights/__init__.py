"""Finding checkpoints and reading weight formats (safetensors, CTranslate2, .pt with weights_only)."""
