"""Getting models from the Hugging Face Hub: the client (huggingface_hub with one-line errors), the shard-by-shard
converter behind `coli convert hf://...`, `coli pull` of published containers, and the registry of what is local."""
