"""Parley: a chat server for large language models on PyTorch."""

__version__ = "0.1.0"
