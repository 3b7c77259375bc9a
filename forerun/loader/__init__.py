"""Reading a Hugging Face folder or a GGUF file into named tensors, a config and a tokenizer: GGUF
conversion (tensors, tokenizer, quantized blocks kept beside), safetensors reading and the `--model`
resolution; nothing of the model's forward.
"""
