"""Runtime services around the models: sharing one loaded engine between users in a process."""
