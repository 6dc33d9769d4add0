"""megaopd.engine: the embedded engine without HTTP: an HF transformers model that prefills and decodes
batches of rows with a KV cache, loads HF-named weights (or a LoRA adapter merged into them: engine/lora.py) and
releases its memory by SGLang's tags.

The trainer reaches it through megaopd.rollout.embedded (the Engine protocol over the runner), and
`megaopd serve` through megaopd.serving; nothing here imports either."""
