"""InputHealth: messages lost on the way counted from each publisher's sequence numbers, and a run
of failures that turns a node's diagnostics to ERROR until an input succeeds."""
from photon_ros.input_health import FAILING_IN_A_ROW, InputHealth


def info(publisher: int, sequence: int | None) -> dict:
    return {"publication_sequence_number": sequence, "publisher_gid": {"data": bytes([publisher] * 16)}}


def test_gaps_in_each_publishers_numbers_are_counted():
    health = InputHealth()
    assert health.arrived(info(1, 5)) == 0          # before the first one seen: unknowable, not counted
    assert health.arrived(info(1, 6)) == 0
    assert health.arrived(info(2, 1)) == 0          # another publisher has numbers of its own
    assert health.arrived(info(1, 10)) == 3
    assert health.arrived(info(2, 3)) == 1
    assert health.arrived(info(1, 8)) == 0          # late (out of order) is not lost
    assert health.arrived(info(1, 11)) == 0
    assert health.arrived(info(1, None)) == 0 and health.arrived(None) == 0   # a middleware without numbers
    assert health.lost_in_transport == 4


def test_failing_in_a_row_until_a_success():
    health = InputHealth()
    for i in range(FAILING_IN_A_ROW - 1):
        health.failed(f"bad {i}")
    assert health.failing("frames") == ""
    health.failed("unknown encoding 'yuv420p'")
    assert health.failing("frames") == f"the last {FAILING_IN_A_ROW} frames all failed (last: unknown encoding 'yuv420p')"
    health.succeeded()
    assert health.failing("frames") == ""


def test_reset_forgets_the_failures_and_each_publishers_numbers():
    """A node configured again (another model, a new subscription) starts afresh: the old run of
    failures named a model or a subscription that is gone, and the first message the new
    subscription gets is not a loss after the last one the old subscription got."""
    health = InputHealth()
    health.arrived(info(1, 5))
    health.arrived(info(1, 8))
    for i in range(FAILING_IN_A_ROW):
        health.failed(f"CUDA out of memory {i}")
    health.reset()
    assert health.failing("transcriptions") == "" and health.last_error == ""
    assert health.lost_in_transport == 0
    assert health.arrived(info(1, 20)) == 0   # the publisher went on while no subscription existed
    assert health.arrived(info(1, 22)) == 1
