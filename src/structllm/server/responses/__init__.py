"""``/v1/responses``: OpenAI's Responses API, served through chat's prompt,
tool calling, structured output and reasoning."""
