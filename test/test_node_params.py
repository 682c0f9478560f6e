"""Float parameters take whole numbers (photon_ros.params): rclpy types a parameter by its default
and refuses `0` for one declared 5.0, which stopped a node configured with `caption_period_s: 0`
from starting. Real rclpy nodes, no DDS traffic needed."""
import pytest
import rclpy
from rclpy.node import Node
from rclpy.parameter import Parameter

from photon_ros.params import declarer, number


@pytest.fixture
def context():
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    yield ctx
    rclpy.shutdown(context=ctx)


def test_a_float_parameter_takes_a_whole_number(context):
    node = Node("params_test", context=context, parameter_overrides=[
        Parameter("gain", value=2), Parameter("period", value=0.5), Parameter("name", value="x")])
    try:
        p = declarer(node)
        assert p("gain", 1.5).value == 2.0 and isinstance(p("gain2", 1.5).value, float)
        assert p("period", 1.0).value == 0.5
        assert p("name", "y").value == "x" and p("count", 3).value == 3   # other types as rclpy has them
        assert node.set_parameters([Parameter("gain", value=4)])[0].successful
        # Plain rclpy, for the record: the refusal the helper avoids.
        with pytest.raises(Exception, match="INTEGER"):
            Node("plain", context=context, parameter_overrides=[Parameter("gain", value=2)]).declare_parameter("gain", 1.5)
    finally:
        node.destroy_node()


def test_a_float_parameter_refuses_what_is_not_a_number(context):
    node = Node("params_bad", context=context, parameter_overrides=[Parameter("gain", value="fast")])
    try:
        with pytest.raises(ValueError, match="'gain' must be a number"):
            declarer(node)("gain", 1.5)
    finally:
        node.destroy_node()
    assert number(True) is None and number("1") is None and number(3) == 3.0
