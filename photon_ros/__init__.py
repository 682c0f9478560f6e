"""ROS 2 nodes and message conversions for the photon_core engine."""
# The generated interfaces (photon_ros.msg, photon_ros.srv) are installed by colcon beside this
# package; extending the path lets the source tree and the install tree form one package.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
