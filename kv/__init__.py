"""Paged KV cache: block-major pool, block accounting with prefix cache, transfer engines."""
