"""What a request that resumes output (resume_token_ids) may not also ask for, per route.

The engine refuses the rest (n > 1, structured outputs, tokens out of the vocabulary or beyond
max_tokens: see engine/validation.py); these are the routes' own features.
"""

from __future__ import annotations

from kvpilot.runtime.server.errors import bad_request
from kvpilot.runtime.server.protocol import GenerationRequest


def refuse_resume_with(body: GenerationRequest, features: dict[str, bool]) -> None:
    """400 naming resume_token_ids when a request continuing output also asks for one of the
    `features` (name -> whether asked) that a continued sequence cannot have."""
    asked = [name for name, on in features.items() if on]
    if body.resume_token_ids and asked:
        raise bad_request(f"resume_token_ids cannot be combined with {' or '.join(asked)}", "resume_token_ids")
