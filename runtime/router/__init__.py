"""The fleet router: `kvpilot router`, an OpenAI-compatible proxy that picks a replica per request."""
