# Source this (". scripts/dev_env.sh") to work in the development environment:
# the venv, the ROS 2 wheels' prefix, and the built workspace when it exists.
# Discovery is pinned to this machine: on a robot, source install/setup.bash of your own
# workspace instead and keep ROS 2's defaults.
_photon_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$_photon_root/.venv/bin/activate"
case ":${AMENT_PREFIX_PATH:-}:" in *":$VIRTUAL_ENV:"*) ;;
  *) export AMENT_PREFIX_PATH="$VIRTUAL_ENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}" ;; esac
case ":${CMAKE_PREFIX_PATH:-}:" in *":$VIRTUAL_ENV:"*) ;;
  *) export CMAKE_PREFIX_PATH="$VIRTUAL_ENV${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}" ;; esac
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
# ROS_DOMAIN_ID is left as it is (ROS 2's 0 when unset), so every terminal that sources this
# file shares one graph; test runs and the demo take a domain of their own (test/conftest.py,
# scripts/setup.sh).
# Camera frames between processes need a shared-memory segment larger than Fast DDS's 512 KiB
# (config/fastdds_large_data.xml says why). A profile the user already chose wins.
if [ -z "${FASTDDS_DEFAULT_PROFILES_FILE:-}" ] && [ -z "${FASTRTPS_DEFAULT_PROFILES_FILE:-}" ]; then
  export FASTDDS_DEFAULT_PROFILES_FILE="$_photon_root/config/fastdds_large_data.xml"
fi
if [ -f "$_photon_root/install/setup.bash" ]; then
  . "$_photon_root/install/setup.bash"
fi
# The source tree first: the workspace holds copies of our Python packages that a rebuild
# refreshes, and a developer edits the source (photon_ros.msg still comes from the workspace).
case ":${PYTHONPATH:-}:" in *":$_photon_root:"*) ;;
  *) export PYTHONPATH="$_photon_root${PYTHONPATH:+:$PYTHONPATH}" ;; esac
unset _photon_root
