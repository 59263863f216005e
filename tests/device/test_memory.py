import subprocess
import sys
import textwrap

# a fresh process: glibc's threshold, once lowered, stays so for the whole process
FREE_A_BLOCK = textwrap.dedent(
    """
    import sys
    import torch
    from lever_actors.device.memory import map_large_blocks

    def anonymous() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    # a block freed at once: glibc's own thresholds rise (as loading a model makes them)
    torch.ones(24 << 20, dtype=torch.uint8)
    if sys.argv[1] == "map":
        map_large_blocks()
    kept = torch.ones(24 << 20, dtype=torch.uint8)  # a step's temporary of that size
    held = anonymous()
    del kept
    print(held - anonymous())
    """
)


def returned_bytes(policy: str) -> int:
    run = subprocess.run(
        [sys.executable, "-c", FREE_A_BLOCK, policy], capture_output=True, text=True, check=True
    )
    return int(run.stdout)


def test_freed_temporaries_go_back_to_the_kernel_once_large_blocks_are_mapped():
    assert returned_bytes("map") >= 24 << 20


def test_without_it_glibc_keeps_them_in_its_heap():
    assert returned_bytes("default") < 4 << 20
