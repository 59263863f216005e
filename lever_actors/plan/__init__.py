"""Everything decided once at start from the machine and the memory the process may use:
the memory plan (memory.py), the context a request may fill (context.py), how many requests
decode at once (parallel.py) and how tokens are proposed (decode.py)."""
