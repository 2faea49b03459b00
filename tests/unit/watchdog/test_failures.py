"""Which exceptions the guard takes for a hang or a lost peer (its report, exit 75) rather than a plain error."""
import pytest

from plugin.watchdog.guard import distributed_failure, short


@pytest.mark.parametrize("text", ["[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 20000ms "
                                  "for recv operation to complete",
                                  "Application timeout caused pair closure",  # a peer's gloo gave up first
                                  "[gloo/transport/tcp/pair.cc:538] Connection closed by peer"])
def test_gloo_failures_are_distributed(text):
    assert distributed_failure(RuntimeError(text))
    try:  # torch's pipeline stages re-raise them
        try:
            raise RuntimeError(text)
        except RuntimeError as e:
            raise RuntimeError("[Stage 0] failed to run forward") from e
    except RuntimeError as chained:
        assert distributed_failure(chained)


def test_a_plain_error_is_not():
    assert not distributed_failure(ValueError("Timed out"))  # not a RuntimeError
    assert not distributed_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))


def test_short_drops_gloos_source_path():
    text = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 20000ms for recv operation\nmore"
    assert short(RuntimeError(text)) == "Timed out waiting 20000ms for recv operation"
