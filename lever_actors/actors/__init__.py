"""The five actors of a decoding step, one module each.

Every actor is a class whose `__init__` does no I/O and whose one entry point is
`async def run(self, inbox, outbox, *, task_status)`. It owns its channel ends and closes
them with a plain `with`, not `async with`: the synchronous close has no checkpoint, so a
Cancelled delivered there cannot replace the actor's own error on its way out.
"""
