"""Everything decided once at start from the machine and the memory the process may use,
kept whole as the engine's StartPlan (start.py): the memory plan (memory.py), how tokens are
proposed (decode.py), the context a request may fill (context.py) and how many requests
decode at once (parallel.py)."""
