"""Speculative decoding building blocks: n-gram drafting and verification."""
