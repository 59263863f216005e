"""The peer: the transformers library, as a Python user would run it today, on the same
weights (needs transformers and accelerate: the `bench` or `dev` extra).

peer-memory: the whole model in DRAM. peer-offload: the target offloaded to disk through
accelerate (`device_map="auto"`, `max_memory={"cpu": budget}`, `offload_folder`), plain
greedy `generate`. peer-assisted: the same with `assistant_model=` our draft.

Honest flash figures: the weight files are dropped from DRAM before loading (so that, in a
child process, everything the peer reads is charged to its memory cgroup) and before every
prompt; the weights accelerate keeps on "cpu", and the assistant, are copied out of the
memory-mapped files into the process's own memory, so they stay resident as ours do and
every read of an offloaded weight goes through the page cache, which a memory cgroup bounds.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import torch
import trio

from lever_actors.bench.isolation import evict_from_page_cache, storage_read_bytes
from lever_actors.bench.mode import Decoded, ModeFailed
from lever_actors.bench.results import ModeInfo
from lever_actors.bench.specs import PeerSpec
from lever_actors.checkpoints.export import export_hf
from lever_actors.device.layout import DTYPE_NAMES
from lever_actors.device.manifest import MANIFEST_NAME
from lever_actors.model.sampling import Sampling
from lever_actors.progress import ProgressLine


class PeerHF:
    def __init__(self, info: ModeInfo, spec: PeerSpec) -> None:
        self.info = info
        self.model_path = Path(spec.model)
        self.dtype = DTYPE_NAMES[spec.dtype]
        self.max_memory_bytes = spec.max_memory_bytes
        self.offload_folder = spec.offload_folder
        self.assistant_path = Path(spec.assistant) if spec.assistant else None
        self.assistant_dtype = DTYPE_NAMES[spec.assistant_dtype or spec.dtype]
        self.evict = [Path(p) for p in spec.evict]
        self.assistant: torch.nn.Module | None = None

    async def open(self, stack: AsyncExitStack) -> None:
        await trio.to_thread.run_sync(self._load)

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM  # optional: the `bench` extra

        sources = [self.model_path, *([self.assistant_path] if self.assistant_path else [])]
        evict_from_page_cache([*sources, *self.evict])
        kwargs: dict = {"dtype": self.dtype}
        if self.model_path.suffix == ".gguf":
            directory, kwargs["gguf_file"] = self.model_path.parent, self.model_path.name
        else:
            directory = self.model_path
        if self.max_memory_bytes is not None:
            kwargs |= {
                "device_map": "auto",
                "max_memory": {"cpu": self.max_memory_bytes},
                "offload_folder": self.offload_folder,
            }
        self.model = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs).eval()
        _own_memory(self.model)
        if self.assistant_path is not None:
            self.assistant = AutoModelForCausalLM.from_pretrained(
                str(self.assistant_path), dtype=self.assistant_dtype
            ).eval()
            _own_memory(self.assistant)
        evict_from_page_cache(self.evict)
        self.info = msgspec.structs.replace(self.info, note=placement_note(self.model))

    async def decode(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int], sampling: Sampling
    ) -> Decoded:
        if not sampling.greedy:
            raise ModeFailed("the transformers peer decodes greedily only")
        return await trio.to_thread.run_sync(self._generate, prompt, max_new_tokens, stop_ids)

    def _generate(
        self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]
    ) -> Decoded:
        evict_from_page_cache(self.evict)
        stamps = _StampingStreamer()
        stops = sorted(stop_ids)
        extra: dict[str, torch.nn.Module] = (
            {"assistant_model": self.assistant} if self.assistant is not None else {}
        )
        read_before = storage_read_bytes()
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stops or None,
                pad_token_id=stops[0] if stops else 0,
                streamer=stamps,
                **extra,
            )
        read_after = storage_read_bytes()
        tokens = out[0, len(prompt) :].tolist()
        decoded = Decoded(
            tokens,
            stamps.stamps[: len(tokens)],
            steps=stamps.steps,
            first_step_tokens=min(stamps.first_step_tokens, len(tokens)) or 1,
        )
        if read_before is not None and read_after is not None:
            decoded.bytes_read = read_after - read_before
        return decoded


def _own_memory(model: torch.nn.Module) -> None:
    """Copy every loaded parameter into memory of its own: transformers leaves them as views
    of the memory-mapped safetensors file, which the kernel may drop and read back at will."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.device.type == "cpu":
                parameter.data = parameter.data.clone()


def placement_note(model: torch.nn.Module) -> str | None:
    """Where accelerate put the model: e.g. "accelerate placed model.embed_tokens and 3/28
    layers on cpu, the rest on disk"."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return None
    if set(device_map) == {""}:
        return f"accelerate placed the whole model on {device_map['']}"
    layers = [k for k in device_map if ".layers." in f".{k}."]
    n_layers = getattr(model.config, "num_hidden_layers", len(layers))
    on = Counter(str(device_map[k]) for k in layers)
    others = [f"{k}: {v}" for k, v in device_map.items() if k not in layers]
    layer_text = ", ".join(f"{n}/{n_layers} layers on {d}" for d, n in sorted(on.items()))
    if not layers:
        layer_text = f"all {n_layers} layers on {device_map.get('model.layers', '?')}"
    return f"accelerate placed {layer_text}; {', '.join(others)}"


class _StampingStreamer:
    """transformers calls put() with the prompt first, then with the tokens of each step:
    one token per step in plain decoding, the accepted ones plus one in assisted decoding."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.steps = 0
        self.first_step_tokens = 0
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            now = time.perf_counter()
            self.stamps.extend([now] * value.numel())
            self.steps += 1
            if self.steps == 1:
                self.first_step_tokens = value.numel()
        self._seen_prompt = True

    def end(self) -> None:
        pass


def hf_export_for(path: Path, dtype: str, cache: Path) -> Path:
    """An HF directory with the weights of `path` as `dtype`, for the peer: `path` itself when
    it is one, else an export made once beside a flash layout or into `cache` for a GGUF file."""
    if path.is_dir() and not (path / MANIFEST_NAME).is_file():
        return path  # already an HF directory
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}[dtype]
    parent = path.parent if path.is_dir() else cache
    out = parent / f"{path.stem if path.is_file() else path.name}.hf-{short}"
    if not (out / "config.json").is_file():
        print(
            f"exporting {path.name} as an HF directory for the peer (once): {out}", file=sys.stderr
        )
        export_hf(path, out, DTYPE_NAMES[dtype], progress=ProgressLine(sys.stderr))
    return out
