"""Placeholder while the compressed cache is written."""
ATTENTION_NAME = "sdpa"
