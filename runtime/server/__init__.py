"""The API-server process: the OpenAI-compatible HTTP API over AsyncLLM, tenants, auth and metrics."""
