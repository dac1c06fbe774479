"""Planning for clusters this project never runs on: per-GPU memory, reshard plans on
meta tensors, and a discrete-event simulator of RL steps with and without TLT."""
