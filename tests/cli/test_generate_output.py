"""The stats line `generate` prints at the end."""

from lever_actors.cli.generate_output import Summary


def _summary(**figures) -> Summary:
    return Summary(
        prompt_tokens=41,
        generated_tokens=128,
        finish_reason="length",
        first_token_seconds=0.5,
        prefill_tokens_per_second=82.0,
        decode_tokens_per_second=19.25,
        peak_rss_bytes=3 << 29,
        seed=None,
        **figures,
    )


def test_the_line_names_the_taken_proposals_whoever_proposed_them():
    line = _summary(steps=100, tokens_per_step=1.28, from_draft=28).line()
    assert "100 steps (1.28 per step, 28 proposed)" in line
    assert "draft" not in line  # the plain path's proposals are copies from the text


def test_without_the_pipelines_figures_the_line_leaves_them_out():
    line = _summary().line()
    assert line.startswith("128 tokens (length); prompt 41 tokens; first token after 0.50 s")
    assert "steps" not in line and "decode 19.25 tok/s" in line and "peak RSS 1.50 GiB" in line
