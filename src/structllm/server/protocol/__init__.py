"""The request and response pieces the rooms share: field types, validation,
refusals, output formats, tool definitions, logprobs, the common bodies."""
