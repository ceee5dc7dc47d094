"""``/v1/chat/completions``: its route, protocol models (with the messages) and
serving (with the tool-call parsing of answers and the reasoning split)."""
