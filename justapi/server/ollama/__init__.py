"""Ollama's API family: /api/chat, /api/generate, /api/embed, /api/tags, ... (routes.py)."""
