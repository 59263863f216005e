"""Readers for HF safetensors directories, GGUF files and flash layouts (checkpoints/load.py
loads any of them whole), their tokenizers, conversion and the real pair's download."""
