"""photon_core: the inference engine (Moondream and Whisper), importable without ROS."""
