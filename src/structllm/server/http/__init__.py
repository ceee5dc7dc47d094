"""The HTTP pieces every room shares: body intake, errors, SSE, auth, limits,
drain, the access log."""
