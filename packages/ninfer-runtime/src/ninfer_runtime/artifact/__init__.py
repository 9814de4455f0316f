"""The `.ninfer` artifact: one self-describing safetensors file (see format.py)."""
