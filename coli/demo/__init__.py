"""The built-in demo model: a tiny trained glm_moe_dsa with a byte-level BPE tokenizer (package data)."""
