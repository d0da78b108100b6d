"""The Anthropic Messages API (``POST /v1/messages``) over kvflow's chat serving."""
