"""What a request's text becomes: stop strings held back until they cannot begin (stop.py),
tool calls read back from it (tool_calls.py), and why it ends (finish.py)."""
