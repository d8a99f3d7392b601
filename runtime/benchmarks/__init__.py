"""`kvpilot bench`: load generators and reports against any OpenAI-compatible server."""
