"""Models in and out: glmc checkpoints (safetensors), Hugging Face and timm folders, live modules, user data files."""
