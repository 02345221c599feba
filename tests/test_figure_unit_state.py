"""Lesson 05's state diagram of a unit's buffer: every state, and which method (called from
which hook) moves the buffer along each edge, including the prefetch nobody used."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from zerokit.figures import unit_state_figure  # noqa: E402


def test_the_diagram_names_every_state_and_what_moves_the_buffer(tmp_path):
    fig = unit_state_figure()
    texts = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    for state in ("shard only", "gathering", "full", "freed"):
        assert state in texts, state
    for method in ("start_gather", "finish_gather", "free", "gather_buffer"):
        assert method in texts, method
    for hook in ("pre_forward", "pre_backward", "post_forward", "send", "_end_of_backward"):
        assert hook in texts, hook
    assert "nobody used" in texts  # the edge gathering -> freed: the buffer is released there too
    assert "resize_(0)" in texts
    fig.savefig(tmp_path / "states.png")
    plt.close(fig)
