"""OpenAI's Responses API, stateless: /v1/responses (routes.py)."""
