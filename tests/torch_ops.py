"""Which torch ops ran on the test's own thread (the event loop's, in an async test)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# a tensor made from Python data: no product, so no OpenMP team
MADE_FROM_DATA = "aten.lift_fresh.default"


class OpsOnThisThread(TorchDispatchMode):
    """Records every op dispatched on the thread that entered it: torch keeps the mode
    stack per thread, so ops on compute units' threads are not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @property
    def computed(self) -> list[str]:
        """The ops that compute, not just hold data made in Python."""
        return [op for op in self.ops if op != MADE_FROM_DATA]
