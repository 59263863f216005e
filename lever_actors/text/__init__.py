"""What a request's text becomes: stop strings held back until they cannot begin (stop.py)
and tool calls read back from it (tool_calls.py)."""
